"""The diagnosis with cadence's per-step wait for a CPU (`t_step_cpu_wait_ns`: how long the
worker's engine threads waited in the run queue in each step): a slow step whose threads
waited for a CPU as long as it was late is the host's, not the engine's. Built by hand as a
2-core host would record a cadence server's streams stepped together every 10 ms, a few steps
slow, with and without the figure (a result from before it existed)."""

from __future__ import annotations

import msgspec

from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.analysis.verdict import judge
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult, to_builtins
from tests.unit.lab.test_coincidence import MS, as_bench, on_contended_host, timed
from tests.unit.lab.test_full_host_waits import RULE as THREADS_RULE
from tests.unit.lab.test_full_host_waits import on_host

SLOW = dict.fromkeys((20, 50, 80, 110, 140), 14)
"""Five steps 14 ms slow (of 150): a bad ITL tail."""


def waited(
    records: list[RequestRecord], extra_ms: dict[int, float], usual_ms: float = 0.5
) -> list[RequestRecord]:
    """Each chunk's step waited `usual_ms` for a CPU, and the steps of `extra_ms` that much
    more (one chunk a step: chunk i is step i)."""
    for r in records:
        r.t_step_cpu_wait_ns = [
            int((usual_ms + extra_ms.get(i, 0.0)) * MS) for i in range(len(r.arrival_ns))
        ]
    return records


def contended(records: list[RequestRecord]) -> BenchResult:
    """On a 2-core host other work filled, whose sleeping threads woke at most 2 ms late: a
    wake-up explains little of a 14 ms slow step."""
    result = on_contended_host(as_bench(records), wakeup_max=2.0)
    result.diagnosis = diagnose(result)
    return result


def alarms(result: BenchResult) -> dict[str, dict]:
    return {f.rule: f.evidence for f in result.diagnosis if f.alarm}


def test_slow_steps_whose_threads_waited_for_a_cpu_are_the_hosts() -> None:
    """The slow steps' threads waited 14 ms more than usual for a CPU: the host's, all of the
    tail (`host_contended` explains it, the engine is not named, nothing left unexplained).
    The same run without the figure puts the steps on the engine: a wake-up is not a slice."""
    result = contended(waited(timed(slow_steps=SLOW), SLOW))
    found = alarms(result)
    assert set(found) == {"host_contended"}, found
    assert found["host_contended"]["itl_tail_share"] > 0.9
    assert found["host_contended"]["slow_gaps_on_steps_that_waited"] == 5 * 16
    assert found["host_contended"]["step_cpu_wait_at_those_max_ms"] == 14.0
    verdict, unexplained = judge(result)
    itl = next(t for t in verdict.tails if t.metric == "itl_ms")
    assert itl.state == "bad" and itl.explained_by["host_contended"] > 0.9
    assert not unexplained
    before = contended(timed(slow_steps=SLOW))
    assert "itl_unstable_engine" in alarms(before)
    assert alarms(before)["host_contended"]["itl_tail_share"] < 0.7


def test_a_slow_step_that_outlasts_its_wait_stays_partly_the_engines() -> None:
    """The slow steps' threads waited 4 ms more than usual: that much of each is the host's
    (more than a 2 ms wake-up gives it without the figure), the other 10 ms the engine's own,
    which is named."""
    result = contended(waited(timed(slow_steps=SLOW), dict.fromkeys(SLOW, 4.0)))
    found = alarms(result)
    assert "itl_unstable_engine" in found, found
    engine, host = found["itl_unstable_engine"], found["host_contended"]
    without = alarms(contended(timed(slow_steps=SLOW)))["host_contended"]["itl_tail_share"]
    assert without < host["itl_tail_share"] < engine["itl_tail_share"]
    assert abs(host["itl_tail_share"] + engine["itl_tail_share"] - 1) < 0.01
    assert not judge(result)[1]


def test_a_worker_whose_every_step_waits_is_judged_against_its_usual_wait() -> None:
    """Every step waited 5 ms (the worker's usual, in its typical step already) and the slow
    steps no more: their lateness is not the host's, so the engine keeps them."""
    result = contended(waited(timed(slow_steps=SLOW), {}, usual_ms=5.0))
    assert "itl_unstable_engine" in alarms(result)
    assert "slow_gaps_on_steps_that_waited" in alarms(result)["host_contended"]
    assert alarms(result)["host_contended"]["slow_gaps_on_steps_that_waited"] == 0


def full_host(records: list[RequestRecord], step_wait: float) -> BenchResult:
    """On a 2-core host the server and its client filled (no other work), the workers'
    busiest threads waiting `step_wait` % of the run by the thread samples."""
    result = on_host(as_bench(records), step_wait=step_wait)
    result.diagnosis = diagnose(result)
    return result


def test_on_a_host_the_server_filled_the_steps_own_waits_decide_not_the_samples() -> None:
    """Where the server and its load filled the host, the engine gives way to the threads'
    waits when the slow steps waited as long as they were late: read from the steps' own
    figure when the run has it, which overrides the thread samples' approximation both ways
    (samples say too little waiting; samples say enough, the steps say none)."""
    slow = dict.fromkeys((20, 50, 80, 110, 140), 15)
    records = timed(slow_steps=slow, worker_step_ms={0: 10, 1: 10})
    assert set(alarms(full_host(records, step_wait=2.0))) == {THREADS_RULE, "itl_unstable_engine"}
    exact = full_host(waited(records, slow), step_wait=2.0)
    assert set(alarms(exact)) == {THREADS_RULE}, alarms(exact)
    records = timed(slow_steps=slow, worker_step_ms={0: 10, 1: 10})
    assert set(alarms(full_host(records, step_wait=30.0))) == {THREADS_RULE}
    none_waited = full_host(waited(records, {}), step_wait=30.0)
    assert set(alarms(none_waited)) == {THREADS_RULE, "itl_unstable_engine"}


def test_a_record_without_the_figure_reads_as_before_it_existed() -> None:
    """A record written before the field (its JSON array ends earlier) reads back with no
    per-step wait, and one with it writes it and reads it back."""
    plain, timed_record = timed(streams=2, tokens=3)
    timed_record.t_step_cpu_wait_ns = [1000, -1, 2000]
    written = to_builtins(BenchResult(records=[plain, timed_record]))["records"]
    fields = RequestRecord.__struct_fields__
    assert len(written[1]) == len(fields) and written[1][-1] == [1000, -1, 2000]
    assert len(written[0]) < fields.index("t_step_cpu_wait_ns")  # left out, as before
    back = msgspec.convert({"records": written}, BenchResult).records
    assert back[0].t_step_cpu_wait_ns == [] and back[1].t_step_cpu_wait_ns == [1000, -1, 2000]


def test_a_slow_first_output_whose_step_waited_for_a_cpu_is_the_hosts() -> None:
    """Two of 16 streams' first outputs 130 ms late, their first step's threads kept off a CPU
    that long: the TTFT tail is the host's (with the figure), not a share of 0."""
    records = waited(timed(), {})
    for r in records[-2:]:
        r.arrival_ns = [t + 130 * MS for t in r.arrival_ns]
        r.end_ns = r.arrival_ns[-1]
        r.t_step_end_ns = [t + 130 * MS for t in r.t_step_end_ns]
        r.t_step_cpu_wait_ns[0] += 130 * MS
    result = contended(records)
    host = alarms(result)["host_contended"]
    assert host["ttft_tail_share"] > 0.9, host
    for r in records:
        r.t_step_cpu_wait_ns = []
    assert alarms(contended(records))["host_contended"]["ttft_tail_share"] < 0.5
