"""Each worker's output curve from chunk timing, and the rule slow_worker on recorded results."""

from __future__ import annotations

import msgspec

from cadence.lab.analysis import diagnosis as dx
from cadence.lab.analysis.stats import summarize
from cadence.lab.analysis.worker_curves import worker_curves
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult

MS = 1_000_000


def stepped(k: int, worker: int, starts: list[int], ends: list[int]) -> RequestRecord:
    """Stream k on `worker`, one token made in each step (start, end ns), at the client half
    a millisecond after its step ends."""
    arrival = [e + MS // 2 for e in ends]
    return RequestRecord(
        request_id=f"bench-{k}",
        process=0,
        start_ns=0,
        end_ns=arrival[-1],
        max_tokens=len(ends),
        finish_reason=1,
        arrival_ns=arrival,
        tokens=[1] * len(ends),
        index=list(range(len(ends))),
        worker=worker,
        t_received_ns=1,
        t_scheduled_ns=1,
        t_step_start_ns=starts,
        t_step_end_ns=ends,
        t_front_recv_ns=ends,
        t_send_ns=ends,
    )


def stream(k: int, worker: int, step_ms: float, steps: int = 40) -> RequestRecord:
    """A stream on `worker`, one token per step of `step_ms`, all streams stepping together."""
    starts = [int(i * step_ms * MS) for i in range(steps)]
    return stepped(k, worker, starts, [s + int(step_ms * MS) for s in starts])


def test_curves_per_worker():
    records = [stream(k, k % 2, 10.0 if k % 2 == 0 else 30.0) for k in range(8)]
    curves = worker_curves(records, {0: "cuda:0", 1: "cuda:1"})
    assert [c.worker for c in curves] == [0, 1]
    fast, slow = curves
    assert (fast.device, slow.device) == ("cuda:0", "cuda:1")
    assert fast.steps == slow.steps == 40
    assert fast.step_ms_p50 == 10.0 and slow.step_ms_p50 == 30.0
    assert fast.sequences_per_step_p50 == 4  # four streams share each of its steps
    assert abs(fast.token_share - 0.5) < 1e-9
    # 4 streams x 40 tokens each, over the run's 1.2 s (the slow worker's last step ends it)
    assert abs(fast.tokens_per_s - 160 / 1.2) < 1e-6
    assert fast.series[0] == (0.0, 10.0, 4)
    assert worker_curves([RequestRecord(request_id="r", process=0, start_ns=0)]) is None
    # Timing fields without step times (a server that fills them with zeros): no curves.
    blank = stream(0, 0, 10.0)
    blank.t_step_end_ns = [0] * len(blank.t_step_end_ns)
    assert worker_curves([blank]) is None


def diagnosed(records: list[RequestRecord]) -> set[str]:
    result = BenchResult(
        **msgspec.structs.asdict(summarize(records)), workers=worker_curves(records, {})
    )
    return {f.rule for f in dx.diagnose(result)}


def test_one_slow_worker_is_named():
    fired = diagnosed([stream(k, k % 2, 10.0 if k % 2 == 0 else 30.0) for k in range(8)])
    assert dx.RULE_SLOW_WORKER in fired


def test_workers_alike_or_only_a_little_slower_are_fine():
    assert dx.RULE_SLOW_WORKER not in diagnosed([stream(k, k % 2, 10.0) for k in range(8)])
    assert dx.RULE_SLOW_WORKER not in diagnosed(
        [stream(k, k % 2, 10.0 if k % 2 == 0 else 12.0) for k in range(8)]
    )


def test_a_worker_with_a_larger_batch_may_step_slower():
    """Worker 1 carries six streams per step against worker 0's one: not a slow card."""
    records = [stream(0, 0, 10.0)] + [stream(k, 1, 30.0) for k in range(1, 7)]
    assert dx.RULE_SLOW_WORKER not in diagnosed(records)


def shared_steps(worker: int, lengths: list[int], step_ms, first: int = 0) -> list[RequestRecord]:
    """Streams of `lengths` tokens on one worker, all starting together and sharing its steps;
    a step with n sequences takes `step_ms(n)` ms."""
    t, starts, ends = 0, [], []
    for i in range(max(lengths)):
        n = sum(1 for length in lengths if length > i)
        starts.append(t)
        t += int(step_ms(n) * MS)
        ends.append(t)
    return [
        stepped(first + k, worker, starts[:length], ends[:length])
        for k, length in enumerate(lengths)
    ]


def test_a_slow_card_holding_more_streams_is_named_by_the_step_model():
    """The slow card's streams last longer, so it holds three times the sequences of the
    others; their steps do not grow with their batch, so it is slow, not busier."""
    fast = shared_steps(0, [10, 20, 30, 40], lambda n: 10.0)
    slow = shared_steps(1, [40] * 12, lambda n: 30.0, first=4)
    assert dx.RULE_SLOW_WORKER in diagnosed(fast + slow)
    assert dx.RULE_ITL_UNSTABLE_ENGINE not in diagnosed(fast + slow)


def test_a_card_whose_steps_cost_what_its_batch_predicts_is_not_slow():
    """Steps of 2 ms plus 2 ms per sequence on both cards: twelve sequences take 26 ms."""
    fast = shared_steps(0, [10, 20, 30, 40], lambda n: 2.0 + 2.0 * n)
    busier = shared_steps(1, [40] * 12, lambda n: 2.0 + 2.0 * n, first=4)
    assert dx.RULE_SLOW_WORKER not in diagnosed(fast + busier)
