"""Planted bottlenecks on real servers: the diagnosis names the one that was planted.

Each test starts `cadence serve` with the synthetic engine set to misbehave in one way, runs a
small bench against it (16 streams; the run itself takes 0.6-2 s after the load generator's
3 s start), and checks that the matching rule fires and that the rules for the other planted
faults do not. The workloads are small because CI has 2 cores; the thresholds in
`cadence.lab.diagnosis` leave room for another benchmark running on the same machine.
"""

from __future__ import annotations

import json

from cadence.lab.analysis import diagnosis as dx
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.results import BenchResult, to_builtins
from tests.integration.conftest import start_server
from tests.integration.host_load import assert_named, contended

ITL_RULES = {dx.RULE_ITL_UNSTABLE_ENGINE, dx.RULE_ITL_UNSTABLE_NETWORK}


def _bench(server_args: list[str], workload: Workload) -> tuple[BenchResult, set[str]]:
    with start_server(*server_args) as server:
        result = run_bench(server.target, workload)
    assert result.requests_ok == workload.requests, result.errors_by_code
    return result, {f.rule for f in result.diagnosis}


def _explain(result: BenchResult) -> str:
    """The findings and the aggregates they read, for a failing assertion's message."""
    result = to_builtins(result)
    keys = ("ttft_ms", "itl_ms", "chunk_tokens", "token_delay_ms")
    aggregates = {
        k: {s: round(result[k][s], 2) for s in ("p50", "p90", "p99", "max")}
        for k in keys
        if k in result
    }
    aggregates["segments_ms"] = {
        name: {s: round(d[s], 2) for s in ("p50", "p90", "p99", "max")}
        for name, d in result.get("segments_ms", {}).items()
    }
    return json.dumps({"diagnosis": result["diagnosis"], **aggregates}, indent=1)


def _assert_not_named(result: BenchResult, fired: set[str], rules: set[str]) -> None:
    """None of `rules` fired. On a host the lab found contended, another job's delays are
    real slow steps, late loop wake-ups and late reads, so those rules may fire beside the
    planted fault (which each test still requires) and the host's own finding."""
    if not contended(result):
        assert not fired & rules, _explain(result)


def test_slow_first_step_is_diagnosed_as_engine_start() -> None:
    """The worker's first step takes 400 ms more; every request waits for it."""
    result, fired = _bench(
        ["--devices", "cpu:1", "--step-ms", "10", "--first-step-ms", "400"],
        Workload(requests=16, concurrency=16, shape=RequestShape(max_tokens=(50, 50))),
    )
    assert dx.RULE_TTFT_ENGINE_START in fired, _explain(result)
    _assert_not_named(
        result, fired, ITL_RULES | {dx.RULE_TTFT_QUEUEING, dx.RULE_FRONT_LOOP_BLOCKED}
    )


def test_jittery_steps_are_diagnosed_as_engine_itl_instability() -> None:
    """Steps of 10 ms with 8 ms of jitter: the gaps vary because the engine does."""
    result, fired = _bench(
        ["--devices", "cpu:1", "--step-ms", "10", "--jitter-ms", "8"],
        Workload(requests=16, concurrency=16, shape=RequestShape(max_tokens=(50, 50))),
    )
    assert dx.RULE_ITL_UNSTABLE_ENGINE in fired, _explain(result)
    _assert_not_named(
        result, fired, {dx.RULE_TTFT_ENGINE_START, dx.RULE_SLOW_READER, dx.RULE_FRONT_LOOP_BLOCKED}
    )


def test_slow_reader_is_diagnosed_on_the_network_side() -> None:
    """Clients pause 30 ms after every chunk while the engine makes a token every 5 ms."""
    result, fired = _bench(
        ["--devices", "cpu:1", "--step-ms", "5"],
        Workload(
            requests=16, concurrency=16, shape=RequestShape(max_tokens=(60, 60)), read_delay_ms=30
        ),
    )
    assert fired & {dx.RULE_SLOW_READER, dx.RULE_ITL_UNSTABLE_NETWORK}, _explain(result)
    _assert_not_named(
        result,
        fired,
        {dx.RULE_ITL_UNSTABLE_ENGINE, dx.RULE_TTFT_ENGINE_START, dx.RULE_FRONT_LOOP_BLOCKED},
    )


def test_a_blocked_front_loop_is_named_with_the_lag_it_measured() -> None:
    """User code in the front (--app-in-front) blocks the event loop for 60 ms every 0.3 s.
    The server has no metrics endpoint: the loop's lag reaches the bench with the timing."""
    result, fired = _bench(
        ["--app", "tests.apps:loop_blocking_app", "--app-in-front"],
        Workload(requests=32, concurrency=16, shape=RequestShape(max_tokens=(100, 100))),
    )
    assert dx.RULE_FRONT_LOOP_BLOCKED in fired, _explain(result)
    # The engine runs on the blocked loop: its slow steps are the loop's, not the engine's.
    _assert_not_named(
        result,
        fired,
        {dx.RULE_ITL_UNSTABLE_ENGINE, dx.RULE_TTFT_ENGINE_START, dx.RULE_TTFT_QUEUEING},
    )
    assert result.front_loop.samples >= 10
    finding = next(f for f in result.diagnosis if f.rule == dx.RULE_FRONT_LOOP_BLOCKED)
    assert "loop_wakeups_late_over_20ms" in finding.evidence


def test_a_clean_run_names_nothing() -> None:
    result, _ = _bench(
        ["--devices", "cpu:2", "--step-ms", "10"],
        Workload(requests=32, concurrency=16, shape=RequestShape(max_tokens=(50, 50))),
    )
    assert_named(result, set())


def test_one_slow_card_is_named_with_its_streams() -> None:
    """Two workers, the second stepping three times slower: the lab names that worker, and
    does not call it the engine's jitter."""
    result, fired = _bench(
        ["--devices", "cpu:2", "--step-ms-by-worker", "10,30"],
        Workload(requests=32, concurrency=16, shape=RequestShape(max_tokens=(50, 50))),
    )
    assert dx.RULE_SLOW_WORKER in fired, _explain(result)
    _assert_not_named(result, fired, {dx.RULE_ITL_UNSTABLE_ENGINE})
    (finding,) = [f for f in result.diagnosis if f.rule == dx.RULE_SLOW_WORKER]
    assert finding.evidence["worker"] == 1 and finding.evidence["device"] == "cpu"
    curves = {w.worker: w for w in result.workers}
    assert curves[1].step_ms_p50 > 2 * curves[0].step_ms_p50
