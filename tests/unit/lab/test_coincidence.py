"""The coincidence reading of a run's raw records (`diagnosis.reads`, `signatures`,
`coincidence`), on records built by hand as a load process would stamp them from an engine that
steps every open stream together every 10 ms: outputs already buffered when the client reads are
stamped microseconds apart, whatever the protocol (SSE events of one write, gRPC messages of one
HTTP/2 read)."""

from __future__ import annotations

import msgspec

from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.analysis.diagnosis.coincidence import attribution
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.reads import Reads
from cadence.lab.analysis.stats import summarize
from cadence.lab.analysis.verdict import judge
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult, Distribution, HostCpu, System

MS = 1_000_000
US = 1_000
STEP = 10 * MS


def record(k: int, start: int, arrivals: list[int]) -> RequestRecord:
    n = len(arrivals)
    return RequestRecord(
        request_id=f"bench-{k}",
        process=0,
        start_ns=start,
        end_ns=arrivals[-1],
        max_tokens=n,
        finish_reason=2,
        arrival_ns=arrivals,
        tokens=[1] * n,
        index=list(range(n)),
    )


def batched(
    streams: int = 16,
    tokens: int = 60,
    held: int = 1,
    pauses: tuple[int, ...] = (),
    pause_ms: int = 0,
    pairs: set[int] = frozenset(),
) -> list[RequestRecord]:
    """Streams opened together, one token each per step, the client reading stream k 30 us
    after stream k - 1. `held`: outputs written `held` at a time (each read carries them,
    2 us apart); `pauses`: steps before which the engine stops `pause_ms`; `pairs`: streams
    whose outputs come two at a time, every other step."""
    records = []
    for k in range(streams):
        arrivals = []
        for i in range(tokens):
            made = (i + 1) * STEP + sum(pause_ms * MS for p in pauses if i >= p)
            sent = made
            if held > 1:
                sent = ((i // held) + 1) * held * STEP + sum(
                    pause_ms * MS for p in pauses if (i // held + 1) * held - 1 >= p
                )
                sent += (i % held) * 2 * US
            if k in pairs and i % 2 == 0:
                sent = made + STEP  # waits for the next one, then both go
            if k in pairs and i % 2 == 1:
                sent = made + 50 * US
            arrivals.append(sent + k * 30 * US)
        records.append(record(k, k * 20 * US, sorted(arrivals)))
    return records


def as_bench(records: list[RequestRecord]) -> BenchResult:
    result = BenchResult(**msgspec.structs.asdict(summarize(records)))
    result.records = records
    return result


def fired(records: list[RequestRecord]) -> dict[str, dict]:
    return {f.rule: f.evidence for f in diagnose(as_bench(records))}


def test_outputs_stamped_microseconds_apart_are_one_read():
    reads = Reads(batched(held=5))
    assert {n for s in reads.streams for n in s.tokens} == {5}
    assert abs(reads.typical_ms - 10) < 0.5  # a token a step, however they are sent


def test_a_clean_batch_has_no_tail_and_no_finding():
    records = batched()
    assert fired(records) == {}
    tail = attribution(RunFacts(as_bench(records)))
    assert tail.itl_total_ms == tail.ttft_total_ms == 0
    assert tail.itl_ms == tail.ttft_ms == {}


def test_events_written_five_at_a_time_are_output_held_back_not_a_stall():
    """Every stream is silent for four steps at the same instants, and its first output comes
    five steps late: the held outputs explain both, before any stall or fixed cost would."""
    found = fired(batched(held=5))
    assert set(found) == {"output_held_back"}
    assert found["output_held_back"]["tokens_per_read_p50"] == 5
    assert found["output_held_back"]["itl_tail_share"] > 0.95


def test_tokens_in_pairs_are_not_a_slow_stream():
    """A quarter of the streams get their tokens two at a time, every other step: their
    median gap between messages is 0 or 20 ms, but they are no slower."""
    records = batched(pairs={0, 4, 8, 12})
    reads = Reads(records)
    speeds = {s.number: s.speed_ms for s in reads.streams}
    assert max(speeds.values()) < 1.1 * min(speeds.values())
    assert "slow_stream_group" not in fired(records)


def test_a_pause_of_every_stream_is_a_stall_with_its_period():
    found = fired(batched(tokens=80, pauses=(10, 30, 50, 70), pause_ms=80))
    assert set(found) == {"streams_stall_together"}
    stall = found["streams_stall_together"]
    assert stall["shared_stalls"] == 4 and stall["itl_tail_share"] > 0.9
    assert 270 <= stall["stall_every_ms"] <= 290  # 20 steps and one pause apart


def test_two_causes_at_once_each_take_their_share():
    """Held outputs and pauses together: both named, their shares adding up to at most the
    whole tail, the held outputs first."""
    records = batched(tokens=80, held=4, pauses=(12, 32, 52, 72), pause_ms=80)
    found = fired(records)
    assert {"output_held_back", "streams_stall_together"} <= set(found)
    held = found["output_held_back"]["itl_tail_share"]
    stall = found["streams_stall_together"]["itl_tail_share"]
    assert held > 0.2 and stall > 0.2 and held + stall <= 1.0001
    tail = attribution(RunFacts(as_bench(records)))
    accounted = sum(tail.itl_ms.values()) + tail.unexplained_itl_ms
    assert abs(accounted - tail.itl_total_ms) < 1e-6


SERVER_CLOCK = 7_000 * MS
"""The server's monotonic clock is another host's: only differences on it mean anything."""


def timed(
    streams: int = 16,
    tokens: int = 150,
    slow_steps: dict[int, int] | None = None,
    worker_step_ms: dict[int, int] | None = None,
) -> list[RequestRecord]:
    """Streams stepped together with cadence's timing (`t_step_end_ns`): `slow_steps` maps a
    step to the ms it took beyond the others'; `worker_step_ms` gives stream k, on worker
    k % len(...), that worker's steady step."""
    slow_steps = slow_steps or {}
    steps = worker_step_ms or {0: 10}
    records = []
    for k in range(streams):
        worker = k % len(steps)
        step, ends, made = steps[worker] * MS, [], 0
        for i in range(tokens):
            made += step + slow_steps.get(i, 0) * MS
            ends.append(made)
        arrivals = [e + 1 * MS + k * 30 * US for e in ends]
        r = record(k, k * 20 * US, arrivals)
        r.worker = worker
        r.t_step_end_ns = [e + SERVER_CLOCK for e in ends]
        records.append(r)
    return records


def test_slow_gaps_on_the_engines_own_slow_steps_are_the_engine():
    """A few steps of the engine take 25 ms more (a busy host, the card's compute): every
    stream's gap there is slow, too short a silence to be a stall. The server's timing puts
    the tail on the engine, all of it, and leaves nothing unexplained."""
    records = timed(slow_steps={20: 25, 55: 25, 90: 25, 120: 25, 140: 25})
    found = fired(records)
    engine = found["itl_unstable_engine"]
    assert engine["itl_tail_share"] > 0.9
    assert engine["slow_gaps_on_slow_steps"] == 5 * 16
    result = as_bench(records)
    result.diagnosis = diagnose(result)
    verdict, unexplained = judge(result)
    assert verdict.state == "unhealthy" and not unexplained
    itl = next(t for t in verdict.tails if t.metric == "itl_ms")
    assert itl.explained_by["itl_unstable_engine"] > 0.9
    for r in records:  # without the server's timing the same gaps are not put on the engine
        r.t_step_end_ns = []
    assert "itl_unstable_engine" not in fired(records)


def test_a_steadily_slower_worker_is_not_engine_jitter():
    """Half the streams on a worker whose every step takes 20 ms: each of their gaps is slow
    against the run's typical 10 ms, but not against their own worker's steps."""
    found = fired(timed(worker_step_ms={0: 10, 1: 20}))
    assert "itl_unstable_engine" not in found


def test_outputs_written_five_at_a_time_hold_the_first_one_at_the_engines_pace():
    """A writer that flushes every five outputs: ITL p50 is ~0 (four gaps of five are), so a
    TTFT bound of 5 ITL p50 would call every first output (five steps) a bad tail that no rule
    explains. Measured against the typical gap per token it is within its bound; the gaps'
    tail is the held-back output's."""
    result = as_bench(batched(held=5))
    result.diagnosis = diagnose(result)
    verdict, unexplained = judge(result)
    assert not unexplained
    ttft = next(t for t in verdict.tails if t.metric == "ttft_ms")
    assert ttft.state == "healthy" and "typical gap per token" in ttft.bound
    itl = next(t for t in verdict.tails if t.metric == "itl_ms")
    assert itl.state == "bad" and itl.explained_by["output_held_back"] > 0.9


def test_a_ttft_tail_below_the_readings_yardstick_on_a_busy_host_is_put_on_the_host():
    """Two of 32 first outputs 60 ms late on a host other work filled: over the verdict's
    bound (5 steps and the noise floor), under the reading's 100 ms for a slow first output.
    The reading has no tail to split, so the host bears on it without a share rather than
    a share of 0 that would leave the server with all of it (`unexplained_tail`)."""
    records = batched(streams=32, tokens=30)
    for r in records[-2:]:
        r.arrival_ns = [t + 60 * MS for t in r.arrival_ns]
        r.end_ns = r.arrival_ns[-1]
    result = as_bench(records)
    ticks = [0.1 * i for i in range(1, int(result.wall_s * 10) + 4)]
    result.system = System(
        host=HostCpu(
            cpus=2,
            samples=[(t, 195.0, 2.0) for t in ticks],
            wakeups=Distribution(count=500, p50=0.1, p90=0.5, p99=2.0, max=6.0),
        )
    )
    result.diagnosis = diagnose(result)
    [host] = [f for f in result.diagnosis if f.rule == "host_contended"]
    assert "ttft_tail_share" not in host.evidence
    verdict, unexplained = judge(result)
    ttft = next(t for t in verdict.tails if t.metric == "ttft_ms")
    assert ttft.state == "bad" and "host_contended" in ttft.explained_by, verdict.line
    assert not unexplained


def test_a_few_slow_steps_in_a_tail_within_its_bound_are_no_finding():
    """One step of the engine 15 ms slow: all 16 streams' gaps there are slow and the
    engine's steps explain all of that small tail, but ITL p99 stays within the run's bound
    (the verdict calls it healthy): no finding. Five such steps make a bad tail, named."""
    result = as_bench(timed(slow_steps={40: 15}))
    result.diagnosis = diagnose(result)
    assert "itl_unstable_engine" not in {f.rule for f in result.diagnosis}
    assert judge(result)[0].state == "healthy"
    assert "itl_unstable_engine" in fired(
        timed(slow_steps=dict.fromkeys((20, 50, 80, 110, 140), 15))
    )


def on_contended_host(result: BenchResult, wakeup_max: float) -> BenchResult:
    """`result` on a 2-core host other work filled, whose wake-up probe saw up to
    `wakeup_max` ms."""
    ticks = [0.1 * i for i in range(1, int(result.wall_s * 10) + 4)]
    result.system = System(
        host=HostCpu(
            cpus=2,
            samples=[(t, 195.0, 2.0) for t in ticks],
            wakeups=Distribution(count=500, p50=0.1, p90=0.5, p99=2.0, max=wakeup_max),
        )
    )
    return result


def test_slow_steps_within_the_hosts_wake_up_lateness_are_the_hosts():
    """Five steps 14 ms slow make a bad tail. On a host other work filled whose threads woke
    up to 15 ms late, one late wake-up of the step makes each: the tail is the host's, all
    of it, and the engine is not named. Where the host woke them no later than 6 ms, 8 ms of
    each is the engine's own."""
    slow = dict.fromkeys((20, 50, 80, 110, 140), 14)
    result = on_contended_host(as_bench(timed(slow_steps=slow)), wakeup_max=15.0)
    result.diagnosis = diagnose(result)
    assert {f.rule for f in result.diagnosis} == {"host_contended"}
    verdict, unexplained = judge(result)
    itl = next(t for t in verdict.tails if t.metric == "itl_ms")
    assert itl.state == "bad" and itl.explained_by["host_contended"] > 0.9 and not unexplained
    result = on_contended_host(as_bench(timed(slow_steps=slow)), wakeup_max=6.0)
    found = {f.rule: f.evidence for f in diagnose(result)}
    assert found["itl_unstable_engine"]["host_late_per_step_ms"] == 6.0
    assert found["host_contended"]["itl_tail_share"] > 0.2
