"""A server whose output is not whole: counted right, named, and `cadence bench` exits non-zero
(issue 36: a swap once read as one lost, one repeated and one reordered, and the run exited 0)."""

from __future__ import annotations

import json

import msgspec

from cadence.lab.bench_cli import EXIT_INTEGRITY
from cadence.lab.results import BenchResult
from tests.integration.test_grpc_lab import TOKENS_METHOD, TOKENS_REQUEST, cadence, python_server


def bench(tmp_path, target: str, *args: str):
    out = tmp_path / "run.json"
    done = cadence("bench", "--target", target, "--protocol", "grpc", "--no-progress",
                   "--method", TOKENS_METHOD, "--request-json", TOKENS_REQUEST,
                   "--index-field", "index", "--concurrency", "4", "--max-tokens", "10",
                   "--json", str(out), *args)
    return done, msgspec.convert(json.loads(out.read_text()), BenchResult)


def test_a_swap_of_two_outputs_is_one_reorder_and_a_non_zero_exit(tmp_path) -> None:
    with python_server("tests/planted_server.py", "--fault", "swap", "--gap-ms", "5") as target:
        done, result = bench(tmp_path, target)
    integrity = result.integrity
    assert (integrity.lost_tokens, integrity.repeated_tokens, integrity.reordered_chunks) == \
        (0, 0, 1)
    assert done.returncode == EXIT_INTEGRITY, done.stderr
    assert "the output was not whole: reordered_chunks 1" in done.stderr
    [finding] = [f for f in result.diagnosis if f.rule == "integrity_faults"]
    assert finding.evidence["reordered_chunks"] == 1
    assert finding.evidence["streams_with_position_faults"] == 1
    assert "reordered 1" in done.stdout  # the summary's integrity line


def test_a_whole_output_exits_0(tmp_path) -> None:
    with python_server("tests/planted_server.py", "--gap-ms", "5") as target:
        done, result = bench(tmp_path, target)
    assert done.returncode == 0, done.stderr
    assert not [f for f in result.diagnosis if f.rule == "integrity_faults"]
