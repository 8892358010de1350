"""A disaggregated synthetic server whose prefill pool, or decode pool, holds the run back:
the lab names that pool (prefill_pool_bottleneck, decode_pool_bottleneck) and not the other,
sees each worker in its role, and names neither on a healthy disaggregated run.

The runs are small (2-core CI host): each starts `cadence serve --prefill-devices ...
--decode-devices ...` and runs a short bench against it. The bottlenecks are planted with the
synthetic engine's costs: a prefill of 0.1 ms a prompt token (prompts of 1,000-2,000 tokens
keep one prefill worker stepping back to back while three decode workers idle), or a decode
step of 10 ms plus 1 ms a sequence (48 streams on one decode worker).
"""

from __future__ import annotations

from cadence.lab.analysis import diagnosis as dx
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.results import BenchResult
from tests.integration.conftest import start_server
from tests.integration.host_load import contended

POOLS = {dx.RULE_PREFILL_POOL_BOTTLENECK, dx.RULE_DECODE_POOL_BOTTLENECK}
HANDOFF_EVERY_PROMPT = ("--disaggregate-above", "0")


def _bench(server_args: list[str], workload: Workload) -> tuple[BenchResult, set[str]]:
    with start_server(*server_args) as server:
        result = run_bench(server.target, workload)
    assert result.requests_ok == workload.requests, result.errors_by_code
    assert result.integrity.lost_tokens == result.integrity.reordered_chunks == 0
    return result, {f.rule for f in result.diagnosis}


def _roles(result: BenchResult) -> dict[int, str]:
    return {w.worker: w.role for w in result.workers}


def test_one_prefill_worker_for_long_prompts_is_the_prefill_pool() -> None:
    result, fired = _bench(
        [
            "--prefill-devices",
            "cpu:1",
            "--decode-devices",
            "cpu:3",
            "--step-ms",
            "10",
            "--prefill-ms-per-token",
            "0.1",
            *HANDOFF_EVERY_PROMPT,
        ],
        Workload(
            requests=32,
            concurrency=16,
            shape=RequestShape(prompt_tokens=(1000, 2000), max_tokens=(32, 32)),
        ),
    )
    assert _roles(result) == {0: "prefill", 1: "decode", 2: "decode", 3: "decode"}
    assert dx.RULE_PREFILL_POOL_BOTTLENECK in fired, result.diagnosis
    assert dx.RULE_DECODE_POOL_BOTTLENECK not in fired, result.diagnosis
    finding = next(f for f in result.diagnosis if f.rule == dx.RULE_PREFILL_POOL_BOTTLENECK)
    assert finding.evidence["prefill_busy_share"] > finding.evidence["decode_busy_share"]
    # The pool's long admitting steps are not a slow start of the engine, nor one slow card.
    assert not fired & {dx.RULE_TTFT_ENGINE_START, dx.RULE_SLOW_WORKER}, result.diagnosis


def test_many_streams_on_one_decode_worker_are_the_decode_pool() -> None:
    result, fired = _bench(
        [
            "--prefill-devices",
            "cpu:1",
            "--decode-devices",
            "cpu:1",
            "--step-ms",
            "10",
            "--per-seq-ms",
            "1",
            *HANDOFF_EVERY_PROMPT,
        ],
        Workload(
            requests=96,
            concurrency=48,
            shape=RequestShape(prompt_tokens=(32, 32), max_tokens=(48, 48)),
        ),
    )
    assert _roles(result) == {0: "prefill", 1: "decode"}
    assert dx.RULE_DECODE_POOL_BOTTLENECK in fired, result.diagnosis
    assert dx.RULE_PREFILL_POOL_BOTTLENECK not in fired, result.diagnosis
    assert dx.RULE_SLOW_WORKER not in fired, result.diagnosis


def test_a_healthy_disaggregated_run_names_no_pool() -> None:
    result, fired = _bench(
        [
            "--prefill-devices",
            "cpu:1",
            "--decode-devices",
            "cpu:1",
            "--step-ms",
            "10",
            "--prefill-ms-per-token",
            "0.02",
            *HANDOFF_EVERY_PROMPT,
        ],
        Workload(
            requests=32,
            concurrency=8,
            shape=RequestShape(prompt_tokens=(200, 400), max_tokens=(48, 48)),
        ),
    )
    assert _roles(result) == {0: "prefill", 1: "decode"}
    assert result.handoff_segments_ms.requests == 32
    assert not fired & POOLS, result.diagnosis
    # The prefill worker's long steps are its role's, not a slow card's; and on a host that
    # other work leaves alone, the gaps across the hand-offs are not the engine's jitter.
    assert dx.RULE_SLOW_WORKER not in fired, result.diagnosis
    if not contended(result):
        assert not fired & {dx.RULE_ITL_UNSTABLE_ENGINE, dx.RULE_FRONT_LOOP_BLOCKED}, (
            result.diagnosis
        )
