"""Planted servers shaped like real engines (tests/engine_shaped_servers.py: one engine loop
per card stepping a batch of streams), driven as a user would drive a service cadence did not
write: `--protocol grpc` on a method of their own, `--protocol openai` on an aiohttp SSE
server. Each fault, with two parameter sets, must be named with its share of the tail and the
evidence that decided it; two faults at once must both be named; clean servers with jitter
must stay clean. Each run takes 1-4 s after the load generator's start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import grpc
import pytest

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.grpc_schema import from_reflection
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.openai_http import OpenAITarget
from cadence.lab.load.plan import RequestShape
from cadence.lab.results import BenchResult, to_builtins
from tests.engine_shaped_servers import METHOD, MODEL, REQUEST_JSON
from tests.integration.conftest import start_server
from tests.integration.host_load import assert_named, contended
from tests.integration.test_grpc_lab import python_server

LATENCY_RULES = {
    "prefill_stalls_decode",
    "one_stream_at_a_time",
    "gaps_at_fixed_values",
    "streams_stall_together",
    "slow_stream_group",
    "output_held_back",
    "slow_first_message",
    "ttft_grows_with_streams",
}
"""The rules a latency fault of these servers can trip (the integrity and health rules aside)."""


@dataclass(frozen=True)
class Case:
    front: str
    server: tuple[str, ...]
    named: frozenset[str]
    streams: int = 16
    requests: int = 48
    max_tokens: tuple[int, int] = (30, 30)
    prompt_tokens: tuple[int, int] = (16, 16)
    evidence: dict = field(default_factory=dict)
    """rule → {evidence key: (low, high)} that must hold."""
    seed: int = 0
    """The server's jitter and the load's lengths (another seed, another run)."""
    may_also: frozenset[str] = frozenset()
    """Rules that may fire beside `named`, of the same planted fault read another way."""


def bench(case: Case) -> BenchResult:
    with python_server(
        "tests/engine_shaped_servers.py",
        "--front",
        case.front,
        "--seed",
        str(case.seed),
        *case.server,
    ) as target:
        if case.front == "grpc":
            with grpc.insecure_channel(target) as channel:
                schema = from_reflection(channel, METHOD)
            protocol = GrpcTarget(schema=schema, request_json=REQUEST_JSON, index_field="position")
        else:
            protocol = OpenAITarget(base_url=f"http://{target}", model=MODEL)
        workload = Workload(
            requests=case.requests,
            concurrency=case.streams,
            shape=RequestShape(
                max_tokens=case.max_tokens, prompt_tokens=case.prompt_tokens, seed=case.seed
            ),
        )
        result = run_bench(target, workload, protocol=protocol)
    assert result.requests_ok == case.requests, result.errors_by_code
    return result


def explain(result: BenchResult) -> str:
    built = to_builtins(result)
    figures = {
        k: {s: round(built[k][s], 1) for s in ("p50", "p90", "p99", "max")}
        for k in ("ttft_ms", "itl_ms", "chunk_tokens")
    }
    return json.dumps({"diagnosis": built["diagnosis"], **figures}, indent=1)


CASES = {
    # Prefill inside the decode step: per stream, then per prompt token over varied prompts.
    "prefill-per-stream-grpc": Case(
        "grpc",
        ("--prefill-ms", "25"),
        frozenset({"prefill_stalls_decode"}),
        requests=64,
        max_tokens=(20, 40),
        evidence={
            "prefill_stalls_decode": {"ms_per_new_stream": (15, 40), "itl_tail_share": (0.5, 1)}
        },
    ),
    "prefill-per-token-sse": Case(
        "sse",
        ("--prefill-ms-per-token", "0.5", "--decode-ms", "12"),
        frozenset({"prefill_stalls_decode"}),
        requests=64,
        max_tokens=(20, 40),
        prompt_tokens=(20, 80),
        evidence={
            "prefill_stalls_decode": {
                "ms_per_new_prompt_token": (0.25, 0.9),
                "itl_tail_share": (0.5, 1),
            }
        },
    ),
    # No batching: one token for one stream at a time.
    "serial-grpc": Case(
        "grpc",
        ("--serial", "--token-ms", "3"),
        frozenset({"one_stream_at_a_time"}),
        streams=8,
        requests=24,
        max_tokens=(10, 40),
        evidence={"one_stream_at_a_time": {"ms_per_open_stream": (2.5, 6)}},
    ),
    "serial-sse": Case(
        "sse",
        ("--serial", "--token-ms", "2"),
        frozenset({"one_stream_at_a_time"}),
        streams=12,
        requests=36,
        max_tokens=(10, 30),
        evidence={"one_stream_at_a_time": {"ms_per_open_stream": (1.6, 4.5)}},
    ),
    # A writer that holds SSE events and writes them N at a time.
    "buffered-5-sse": Case(
        "sse",
        ("--flush-events", "5"),
        frozenset({"output_held_back"}),
        evidence={"output_held_back": {"tokens_per_read_p50": (5, 5), "itl_tail_share": (0.7, 1)}},
    ),
    "buffered-3-sse": Case(
        "sse",
        ("--flush-events", "3", "--decode-ms", "6", "--jitter", "0.1"),
        frozenset({"output_held_back"}),
        max_tokens=(15, 45),
        evidence={"output_held_back": {"tokens_per_read_p50": (3, 3), "itl_tail_share": (0.5, 1)}},
    ),
    # One card slower than the others.
    "slow-card-of-2-grpc": Case(
        "grpc",
        ("--cards", "2", "--slow-card-factor", "3"),
        frozenset({"slow_stream_group"}),
        evidence={"slow_stream_group": {"slow_streams": (20, 28), "slow_over_fast": (2.2, 3.6)}},
    ),
    "slow-card-of-4-sse": Case(
        "sse",
        ("--cards", "4", "--slow-card-factor", "2.5", "--decode-ms", "8"),
        frozenset({"slow_stream_group"}),
        max_tokens=(20, 40),
        evidence={"slow_stream_group": {"slow_streams": (9, 15), "itl_tail_share": (0.5, 1)}},
    ),
    # The whole process pauses now and then.
    "pauses-grpc": Case(
        "grpc",
        ("--pause-ms", "60", "--pause-every-ms", "400"),
        frozenset({"streams_stall_together"}),
        max_tokens=(40, 40),
        evidence={"streams_stall_together": {"itl_tail_share": (0.5, 1)}},
    ),
    "pauses-sse": Case(
        "sse",
        ("--pause-ms", "80", "--pause-every-ms", "300", "--decode-ms", "8"),
        frozenset({"streams_stall_together"}),
        max_tokens=(40, 60),
        evidence={"streams_stall_together": {"itl_tail_share": (0.5, 1)}},
    ),
    # A hand-off that loses wake-ups, caught by the reader's 50 ms poll timeout.
    "lost-wakeups-grpc": Case(
        "grpc",
        ("--lost-wakeup-share", "0.05", "--poll-ms", "50", "--decode-ms", "5"),
        frozenset({"gaps_at_fixed_values"}),
        max_tokens=(40, 40),
        evidence={"gaps_at_fixed_values": {"gap_value_ms": (49, 58), "itl_tail_share": (0.5, 1)}},
    ),
    # Two faults at once: both named, each with its share.
    "prefill-and-slow-card-grpc": Case(
        "grpc",
        ("--cards", "2", "--slow-card-factor", "2.5", "--prefill-ms", "20"),
        frozenset({"prefill_stalls_decode", "slow_stream_group"}),
        requests=64,
        max_tokens=(20, 40),
        # A burst taken in over a few admitting steps, each with its streams' 20 ms prefills,
        # spreads the burst's first outputs: the steps' spread, not call set-up's.
        evidence={
            "prefill_stalls_decode": {"itl_tail_share": (0.15, 0.9)},
            "slow_stream_group": {"itl_tail_share": (0.1, 0.85)},
        },
    ),
    "slot-limit-and-lost-wakeups-grpc": Case(
        "grpc",
        ("--max-batch", "4", "--lost-wakeup-share", "0.1", "--poll-ms", "50", "--decode-ms", "5"),
        frozenset({"ttft_grows_with_streams", "gaps_at_fixed_values"}),
        max_tokens=(40, 40),
        evidence={
            "ttft_grows_with_streams": {"ttft_tail_share": (0.4, 1)},
            "gaps_at_fixed_values": {"itl_tail_share": (0.4, 1)},
        },
    ),
    # Clean servers whose steps vary: nothing to name.
    "clean-jitter-grpc": Case("grpc", ("--jitter", "0.25"), frozenset()),
    "clean-jitter-sse": Case(
        "sse", ("--jitter", "0.25", "--cards", "2"), frozenset(), max_tokens=(20, 40)
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_an_engine_shaped_fault_is_named_with_its_share(name: str) -> None:
    case = CASES[name]
    result = bench(case)
    assert_named(result, case.named, among=LATENCY_RULES - case.may_also)
    if contended(result):
        return  # another job's stalls of the server blur the sizes the evidence states
    for rule, bounds in case.evidence.items():
        [finding] = [f for f in result.diagnosis if f.rule == rule]
        for key, (low, high) in bounds.items():
            assert low <= finding.evidence[key] <= high, (key, explain(result))


@pytest.mark.parametrize(
    "server_args, named",
    [
        (("--devices", "cpu:2", "--step-ms-by-worker", "10,30"), "slow_stream_group"),
        (("--app", "tests.apps:loop_blocking_app", "--app-in-front"), "streams_stall_together"),
    ],
)
def test_kserve_responses_are_read_by_the_same_rules(server_args, named) -> None:
    """The Open Inference Protocol carries no server timing: the streams' own timestamps name
    a slower worker and a front loop that blocks, as they do for any gRPC method or SSE."""
    from cadence.lab.load.kserve import KServeTarget

    with start_server(*server_args) as server:
        result = run_bench(
            server.target,
            Workload(requests=32, concurrency=16, shape=RequestShape(max_tokens=(60, 60))),
            protocol=KServeTarget("cadence"),
        )
    assert result.requests_ok == 32, result.errors_by_code
    assert not result.segments_ms
    assert_named(result, {named}, among=LATENCY_RULES)
