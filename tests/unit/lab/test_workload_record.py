"""The result's workload record (cadence.lab.results.Workload, JSON `workload`) is a contract:
for each kind of run, its keys and values are pinned here as `cadence bench` writes them. Its
entries follow from the lab's option declarations (cadence.lab.options, `Flag.record`): every
option says which entries carry it, or that none does, so a new flag cannot be left out of the
record unseen."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from cadence.credentials import from_arguments
from cadence.lab import bench, bench_cli, options, results
from cadence.lab.load.cadence_v1 import CadenceTarget
from tests.unit.lab.test_lab_flags import subcommand

PROTO = str(Path(__file__).resolve().parents[3] / "proto")
TARGET = ["--target", "127.0.0.1:50051"]
REQUEST_JSON = '{"request_id": "{request_id}", "max_tokens": "{max_tokens}"}'

DEFAULTS = {
    "target": "127.0.0.1:50051",
    "requests": None,
    "duration_s": None,
    "concurrency": 64,
    "rate": None,
    "max_tokens": [128, 128],
    "prompt_tokens": [16, 16],
    "prompts_from_file": 0,
    "seed": 0,
    "read_delay_ms": 0.0,
    "client_processes": 1,
    "channels_per_process": 1,
    "protocol": "cadence",
    "model": None,
}
"""The record's entries that every run has, as a run with the defaults writes them."""

RUNS = {
    "closed loop": (
        [*TARGET, "--concurrency", "8", "--requests", "32", "--max-tokens", "16:64"]
        + ["--seed", "7", "--procs", "2", "--channels", "3", "--read-delay-ms", "5"],
        {
            **DEFAULTS,
            "requests": 32,
            "concurrency": 8,
            "max_tokens": [16, 64],
            "seed": 7,
            "read_delay_ms": 5.0,
            "client_processes": 2,
            "channels_per_process": 3,
        },
    ),
    "rate": (
        [*TARGET, "--rate", "20", "--duration", "10", "--prompt-tokens", "100"]
        + ["--timeout", "5", "--warmup", "2"],
        {
            **DEFAULTS,
            "duration_s": 10.0,
            "concurrency": None,
            "rate": 20.0,
            "prompt_tokens": [100, 100],
        },
    ),
    "ramp": (
        [*TARGET, "--rate", "5:50", "--ramp", "30s", "--requests", "200", "--saturation-stop"],
        {
            **DEFAULTS,
            "requests": 200,
            "concurrency": None,
            "rate": 50.0,
            "rate_stages": [[5.0, 50.0, 30.0], [50.0, 50.0, math.inf]],
        },
    ),
    "stages": (
        [*TARGET, "--stages", "10:5,20:5"],
        {
            **DEFAULTS,
            "concurrency": None,
            "rate": 20.0,
            "rate_stages": [[10.0, 10.0, 5.0], [20.0, 20.0, 5.0]],
        },
    ),
    "trace": (
        [*TARGET, "--trace", "trace.jsonl", "--trace-speed", "2", "--trace-window", "0:10"]
        + ["--trace-block-tokens", "16", "--session-header", "X-Session"],
        {
            **DEFAULTS,
            "requests": 10,
            "concurrency": None,
            "trace": {
                "file": "trace.jsonl",
                "requests": 10,
                "span_s": 4.5,
                "speed": 2.0,
                "window_s": [0.0, 10.0],
                "block_tokens": 16,
                "with_hash_ids": 5,
                "sessions": 3,
            },
        },
    ),
    "sessions": (
        [*TARGET, "--sessions", "4", "--turns", "2", "--think-ms", "50"]
        + ["--session-header", "x-session-id"],
        {
            **DEFAULTS,
            "requests": 8,
            "concurrency": 4,
            "conversation": {
                "sessions": 4,
                "turns": 2,
                "think_ms": 50.0,
                "session_header": "x-session-id",
            },
        },
    ),
    "mix": (
        [*TARGET, "--class", "chat prompt=128 max=64 slo=ttft_p99_ms=200"]
        + ["--class", "summarize prompt=lognormal:400,100 max=32"]
        + ["--mix", "chat:70%,summarize:30%", "--requests", "10"],
        {
            **DEFAULTS,
            "requests": 10,
            "mix": [
                {
                    "name": "chat",
                    "share": 0.7,
                    "prompt_tokens": [128, 128],
                    "max_tokens": [64, 64],
                    "prompt_length_distribution": None,
                    "output_length_distribution": None,
                    "slo": ["ttft_p99_ms=200"],
                },
                {
                    "name": "summarize",
                    "share": 0.3,
                    "prompt_tokens": [1, 1000000],
                    "max_tokens": [32, 32],
                    "prompt_length_distribution": "lognormal:400,100",
                    "output_length_distribution": None,
                    "slo": [],
                },
            ],
        },
    ),
    "length distributions": (
        [*TARGET, "--prompt-tokens", "lognormal:200,80", "--max-tokens", "normal:64,16,1,128"]
        + ["--requests", "10", "--read-delay-ms", "5@50%", "--cancel-ms", "10@10%"],
        {
            **DEFAULTS,
            "requests": 10,
            "max_tokens": [1, 128],
            "prompt_tokens": [1, 1000000],
            "prompt_length_distribution": "lognormal:200,80",
            "output_length_distribution": "normal:64,16,1,128",
        },
    ),
    "warmup duration": (
        [*TARGET, "--rate", "10", "--duration", "20", "--warmup-duration", "5"],
        {**DEFAULTS, "duration_s": 20.0, "concurrency": None, "rate": 10.0, "warmup_s": 5.0},
    ),
    "prompts file": (
        [*TARGET, "--prompts", "prompts.jsonl", "--requests", "3"],
        {**DEFAULTS, "requests": 3, "prompts_from_file": 2},
    ),
    "openai": (
        ["--protocol", "openai", "--target", "http://127.0.0.1:8000/", "--model", "m"]
        + ["--endpoint", "chat", "--requests", "4"],
        {
            **DEFAULTS,
            "target": "127.0.0.1:8000",
            "requests": 4,
            "protocol": "openai",
            "model": "m",
            "openai": {"base_url": "http://127.0.0.1:8000", "endpoint": "chat"},
        },
    ),
    "kserve": (
        [*TARGET, "--protocol", "kserve", "--model", "simple", "--requests", "4"],
        {**DEFAULTS, "requests": 4, "protocol": "kserve", "model": "simple"},
    ),
    "grpc": (
        [*TARGET, "--protocol", "grpc", "--method", "cadence.v1.Inference/Generate"]
        + ["--proto", "cadence/v1/inference.proto", "--proto-path", PROTO]
        + ["--request-json", REQUEST_JSON, "--index-field", "index"]
        + ["--header", "Authorization=secret", "--header", "x-b=1", "--requests", "4"],
        {
            **DEFAULTS,
            "requests": 4,
            "protocol": "grpc",
            "grpc": {
                "method": "/cadence.v1.Inference/Generate",
                "types_from": "protos",
                "bidirectional": False,
                "request_json": REQUEST_JSON,
                "tokens_field": None,
                "index_field": "index",
                "headers": ["authorization", "x-b"],
            },
        },
    ),
}


def _files(folder: Path) -> None:
    """The trace and prompts the runs above read (relative names: the record keeps them)."""
    rows = [
        {
            "timestamp": t * 1000,
            "input_length": 40,
            "output_length": 8,
            **({"hash_ids": [1, 2]} if t % 2 else {}),
            **({"session_id": f"s{t % 3}"} if t < 6 else {}),
        }
        for t in range(12)
    ]
    (folder / "trace.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "prompts.jsonl").write_text('{"prompt": "hello"}\n{"prompt": "w", "max_tokens": 5}\n')


def workload_record(argv: list[str]) -> dict:
    """The workload record, as JSON holds it, of a `cadence bench` with these flags (the
    protocol as the bench resolves it, short of probing the server)."""
    args = subcommand("bench").parse_args(argv)
    workload = bench_cli.workload_from_args(args)
    kserve, resolve = bench_cli.protocol_from_args(args, "bench")
    openai = bench_cli.openai_from_args(args, "bench")
    grpc = resolve(args.target, from_arguments(args)) if resolve else None
    protocol = openai or grpc or kserve or CadenceTarget()
    address = protocol.address(args.target)
    record = bench._workload_record(address, workload, args.procs, args.channels, protocol)
    return msgspec.to_builtins(record)


@pytest.mark.parametrize("run", RUNS)
def test_the_workload_record_of_each_kind_of_run(
    run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    argv, expected = RUNS[run]
    assert workload_record(argv) == expected


OPTIONS = [o for cls in options.DECLARING for o in options.declared(cls)]
RECORD_KEYS = {f.encode_name for f in msgspec.structs.fields(results.Workload)}


def test_every_option_says_whether_the_workload_record_carries_it() -> None:
    unsaid = [o.flag for o in OPTIONS if o.declared.record is None]
    assert unsaid == [], "say on each Flag: record={KEY: value or DERIVED} or NOT_RECORDED"


def test_the_options_entries_are_the_workload_records() -> None:
    entries = [(key, value) for o in OPTIONS for key, value in (o.declared.record or {}).items()]
    assert {key for key, _ in entries} == RECORD_KEYS
    own = Counter(key for key, value in entries if value is not options.DERIVED)
    assert [key for key, n in own.items() if n > 1] == [], "an option's own entry is its alone"
    derived = {key for key, value in entries if value is options.DERIVED}
    assert derived.isdisjoint(own), "an entry is one option's own or built of several, not both"
