"""Whose is a burst's spread of first outputs: `BurstSpread` (ttft_grows_with_streams: call
set-up, the front taking new streams in one at a time) claims only what its cause made, not
what long admitting steps (their prefills) or a slower card's steps made.

Records are built by hand as cadence's timing would stamp them, from a closed loop of streams
on an engine whose workers step back to back, each step taking in every stream the front
handed it before the step began; then the same records without the server's timing, as a
server the lab did not write would leave them."""

from __future__ import annotations

import msgspec

from cadence.lab.analysis.diagnosis import RULE_TTFT_GROWS_WITH_STREAMS, diagnose
from cadence.lab.analysis.diagnosis.coincidence import Attribution, attribution
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.signatures import (
    TTFT_GROWTH_GAPS,
    TTFT_GROWTH_MIN_MS,
    BurstSpread,
    PrefillStalls,
)
from cadence.lab.analysis.stats import summarize
from cadence.lab.percentile import percentile
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult

MS = 1_000_000


def served(
    *,
    step_ms: tuple[float, ...],
    prefill_ms: float = 0.0,
    set_up_ms: float = 0.0,
    streams: int = 16,
    requests: int = 64,
) -> list[RequestRecord]:
    """`streams` opened at once, then a new one as each ends, `requests` in all; stream k goes
    to worker k % workers (one per `step_ms`). The front takes calls in one at a time, each
    `set_up_ms` after the one before (0: at once, 0.5 ms after it was sent); each step of a
    worker runs the prefills of the streams it takes in (`prefill_ms` each) and makes one token
    for every stream it runs. Outputs reach the client 0.5 ms after their step."""
    workers = len(step_ms)
    start: dict[int, float] = {k: 0.1 * k for k in range(streams)}
    received: dict[int, float] = {}
    scheduled: dict[int, float] = {}
    steps: dict[int, list[tuple[float, float]]] = {k: [] for k in range(requests)}
    tokens = {k: 20 + 7 * k % 21 for k in range(requests)}
    waiting: list[list[int]] = [[] for _ in range(workers)]
    running: list[list[int]] = [[] for _ in range(workers)]
    free = [0.0] * workers
    front = 0.0

    def arrive(k: int) -> None:
        nonlocal front
        front = max(start[k] + 0.5, front + set_up_ms)
        received[k] = front
        waiting[k % workers].append(k)

    for k in range(streams):
        arrive(k)
    opened = streams
    while any(waiting) or any(running):
        at, w = min(
            (free[w] if running[w] else max(free[w], min(received[k] for k in waiting[w])), w)
            for w in range(workers)
            if running[w] or waiting[w]
        )
        taken = [k for k in waiting[w] if received[k] <= at]
        for k in taken:
            waiting[w].remove(k)
            running[w].append(k)
            scheduled[k] = at
        end = at + step_ms[w] + prefill_ms * len(taken)
        for k in list(running[w]):
            steps[k].append((at, end))
            if len(steps[k]) == tokens[k]:
                running[w].remove(k)
                if opened < requests:
                    start[opened] = end + 0.6
                    arrive(opened)
                    opened += 1
        free[w] = end
    ns = lambda values: [int(v * MS) for v in values]  # noqa: E731
    return [
        RequestRecord(
            request_id=f"bench-{k}",
            process=0,
            start_ns=int(start[k] * MS),
            end_ns=int((steps[k][-1][1] + 0.5) * MS),
            prompt_tokens=16,
            max_tokens=tokens[k],
            finish_reason=1,
            arrival_ns=ns(e + 0.5 for _, e in steps[k]),
            tokens=[1] * tokens[k],
            index=list(range(tokens[k])),
            worker=k % workers,
            t_received_ns=int(received[k] * MS),
            t_scheduled_ns=int(scheduled[k] * MS),
            t_step_start_ns=ns(s for s, _ in steps[k]),
            t_step_end_ns=ns(e for _, e in steps[k]),
            t_front_recv_ns=ns(e + 0.2 for _, e in steps[k]),
            t_send_ns=ns(e + 0.3 for _, e in steps[k]),
        )
        for k in range(requests)
    ]


def untimed(records: list[RequestRecord]) -> list[RequestRecord]:
    """The same streams as a server without cadence's timing leaves them: client stamps only."""
    empty = dict.fromkeys(("t_step_start_ns", "t_step_end_ns", "t_front_recv_ns", "t_send_ns"), [])
    return [
        msgspec.structs.replace(r, worker=-1, t_received_ns=0, t_scheduled_ns=0, **empty)
        for r in records
    ]


def as_bench(records: list[RequestRecord]) -> BenchResult:
    result = BenchResult(**msgspec.structs.asdict(summarize(records)))
    result.records = records
    return result


def read(records: list[RequestRecord]) -> Attribution:
    tail = attribution(RunFacts(as_bench(records)))
    assert tail is not None
    return tail


def first_burst_spread(tail: Attribution) -> tuple[float, float]:
    """The first burst's TTFT spread (p90 - p10) and the bar it would have to reach."""
    opened = sorted(tail.reads.streams, key=lambda s: s.start_ns)[:16]
    ttfts = sorted(s.ttft_ms for s in opened)
    bar = max(TTFT_GROWTH_GAPS * tail.reads.typical_ms, TTFT_GROWTH_MIN_MS)
    return percentile(ttfts, 90) - percentile(ttfts, 10), bar


def prefill_on_a_slower_card() -> list[RequestRecord]:
    """Two workers, one 2.5x slower, 30 ms of prefill per stream taken in: each worker's first
    step takes in the one stream that reached it first, its second the seven others, and the
    first outputs of the burst spread over that second step."""
    return served(step_ms=(10.0, 25.0), prefill_ms=30.0)


def test_a_burst_spread_by_admitting_steps_prefills_is_not_call_set_up():
    records = prefill_on_a_slower_card()
    for tail in (read(records), read(untimed(records))):
        spread, bar = first_burst_spread(tail)
        assert spread >= bar  # read from the first outputs alone, it would be set-up's
        assert tail.signature(PrefillStalls) is not None
        assert tail.signature(BurstSpread) is None
        assert tail.ttft_ms.get(RULE_TTFT_GROWS_WITH_STREAMS, 0.0) == 0.0
    fired = [f.rule for f in diagnose(as_bench(untimed(records)))]
    assert RULE_TTFT_GROWS_WITH_STREAMS not in fired


def test_a_burst_spread_by_the_front_taking_calls_one_at_a_time_is_call_set_up():
    records = served(step_ms=(10.0,), set_up_ms=15.0)
    for tail in (read(records), read(untimed(records))):
        spread, bar = first_burst_spread(tail)
        assert spread >= bar
        assert tail.signature(BurstSpread) is not None
        assert tail.ttft_share(RULE_TTFT_GROWS_WITH_STREAMS) >= 0.8
    fired = [f.rule for f in diagnose(as_bench(untimed(records)))]
    assert RULE_TTFT_GROWS_WITH_STREAMS in fired


def test_with_both_the_set_up_keeps_only_its_own_part():
    """Calls taken in one at a time before a worker whose admitting steps run prefills: the
    claim is the front's part, less than the spread the first outputs show."""
    records = served(step_ms=(10.0,), prefill_ms=30.0, set_up_ms=15.0)
    tail = read(records)
    burst = tail.signature(BurstSpread)
    assert burst is not None
    opened = sorted(tail.reads.streams, key=lambda s: s.start_ns)[:16]
    last = max(opened, key=lambda s: s.ttft_ms)
    shown = last.ttft_ms - min(s.ttft_ms for s in opened)
    set_up = (last.record.t_received_ns - last.start_ns) / MS
    assert burst.after[last.number] <= set_up + 15.0 < shown
