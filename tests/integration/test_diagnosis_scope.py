"""Healthy servers that tripped a rule outside its scope (issue 52): each rule must judge
only what its cause makes. Two workers or more stepping out of phase fill each other's gaps,
which is not one stream at a time; a long prefill late in a run is not an engine's start-up;
a worker held to one core is the engine's step, and the advice must say so, not a front's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cadence.lab.analysis import diagnosis as dx
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.load.trace import TraceRow
from tests.integration.conftest import start_server
from tests.integration.test_engine_shaped_diagnosis import explain


def test_batching_workers_out_of_phase_are_not_one_stream_at_a_time() -> None:
    """Four workers of 8 sequences each, steps of about 3 ms that shrink with the batch: the
    other workers' outputs land inside every stream's gap, the shape of streams served in
    turn when the run is read as one; with cadence's timing per worker, without it by the
    groups of streams whose outputs arrive together. Before: fired in 6 of 6 runs."""
    workload = Workload(requests=96, concurrency=32, shape=RequestShape(max_tokens=(16, 96)))
    with start_server("--devices", "cpu:4", "--step-ms", "1", "--per-seq-ms", "0.25") as server:
        timed = run_bench(server.target, workload)
        untimed = run_bench(
            server.target,
            Workload(
                requests=96,
                concurrency=32,
                shape=RequestShape(max_tokens=(16, 96)),
                include_timing=False,
            ),
        )
    for result in (timed, untimed):
        assert result.requests_ok == 96, result.errors_by_code
        assert dx.RULE_ONE_STREAM_AT_A_TIME not in {f.rule for f in result.diagnosis}, explain(
            result
        )
    assert len({r.worker for r in timed.records}) == 4


def test_a_long_prefill_late_in_the_run_is_not_an_engine_start() -> None:
    """Short prompts for 2 s, then one of 400 tokens: its admitting step takes 120 ms, ten
    times a typical step and as long as TTFT's p99, on a worker that had stepped for 2 s.
    That is a prefill, not model load or warm-up."""
    rows = [TraceRow(offset_s=0.05 * k, input_length=8, output_length=20) for k in range(40)]
    rows.append(TraceRow(offset_s=2.05, input_length=400, output_length=20))
    workload = Workload(requests=len(rows), shape=RequestShape(trace=rows))
    with start_server(
        "--devices", "cpu:1", "--step-ms", "5", "--prefill-ms-per-token", "0.3"
    ) as server:
        result = run_bench(server.target, workload)
    assert result.requests_ok == len(rows), result.errors_by_code
    assert result.ttft_segments_ms.first_step.max >= 100  # the trap: one long admitting step
    assert dx.RULE_TTFT_ENGINE_START not in {f.rule for f in result.diagnosis}, explain(result)


def test_the_start_up_stall_is_still_named_on_a_fresh_worker() -> None:
    """The same server with a slow first step of its own (--first-step-ms): named."""
    workload = Workload(requests=16, concurrency=16, shape=RequestShape(max_tokens=(50, 50)))
    with start_server("--devices", "cpu:1", "--step-ms", "10", "--first-step-ms", "400") as server:
        result = run_bench(server.target, workload)
    assert dx.RULE_TTFT_ENGINE_START in {f.rule for f in result.diagnosis}, explain(result)
    assert result.system.processes["worker0"].age_s < 60


@pytest.mark.torch
@pytest.mark.alone  # a thread at its core is seen only where no other test takes the cores
def test_a_worker_held_to_one_core_is_told_its_step_is_the_bound(tmp_path: Path) -> None:
    """`--engine transformers` on one CPU worker steps without pause: its thread is the
    bound. The advice is the engine's (a faster step, more workers), not a front's."""
    pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")
    from tests.transformers_models import save_checkpoint

    folder = save_checkpoint(tmp_path / "llama", "llama")
    workload = Workload(requests=48, concurrency=16, shape=RequestShape(max_tokens=(64, 64)))
    # Held to one core indeed: alone on the host, torch's threads would spread the worker
    # over both cores of a 2-core machine, and no thread would be the bound.
    serve = [sys.executable, "-m", "cadence.cli", "serve", "--port", "0", "--log-level", "WARNING"]
    with start_server(
        "--engine",
        "transformers",
        "--model",
        str(folder),
        "--devices",
        "cpu:1",
        command=["taskset", "-c", "0", *serve],
    ) as server:
        result = run_bench(server.target, workload)
        worker = server.workers[0].pid
    assert result.requests_ok == 48, result.errors_by_code
    bound = [f for f in result.diagnosis if f.rule == dx.RULE_SERVER_ONE_CORE_BOUND]
    for finding in bound:
        # Whichever process it names, the advice fits that process.
        assert "SO_REUSEPORT" not in finding.look_at, explain(result)
        if finding.evidence["pid"] == worker:
            assert finding.evidence["process"] == "worker0"
            assert "engine's step" in finding.finding and "--devices" in finding.look_at
    assert any(f.evidence["pid"] == worker for f in bound), explain(result)
