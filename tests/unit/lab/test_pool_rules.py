"""A disaggregated server's runs as records: each worker's curve in its role, the gap across a
hand-off put on the hand-off, and the rules prefill_pool_bottleneck and decode_pool_bottleneck."""

from __future__ import annotations

import msgspec

from cadence.lab.analysis import diagnosis as dx
from cadence.lab.analysis.diagnosis.coincidence import attribution
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.signatures import SlowSteps
from cadence.lab.analysis.stats import summarize
from cadence.lab.analysis.timeline import timeline
from cadence.lab.analysis.worker_curves import worker_curves
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult

MS = 1_000_000
POOL_RULES = {dx.RULE_PREFILL_POOL_BOTTLENECK, dx.RULE_DECODE_POOL_BOTTLENECK}


def handed_off(
    k: int,
    *,
    received: float,
    prefill: tuple[float, float],
    decode: tuple[int, list[tuple[float, float]]],
    prefill_worker: int = 0,
    export_ms: float = 2.0,
) -> RequestRecord:
    """A stream received at `received` ms, its first token made in the `prefill` step (start,
    end ms) of `prefill_worker`, its state at the front `export_ms` later, the rest made in
    the steps of decode worker `decode[0]`."""
    worker, steps = decode
    starts = [prefill[0], *(s for s, _ in steps)]
    ends = [prefill[1], *(e for _, e in steps)]
    recv = [e + 0.2 for e in ends]
    arrival = [e + 0.5 for e in ends]
    ns = lambda values: [int(v * MS) for v in values]  # noqa: E731
    return RequestRecord(
        request_id=f"bench-{k}",
        process=0,
        start_ns=int(received * MS) - MS // 2,
        end_ns=int(arrival[-1] * MS),
        prompt_tokens=1000,
        max_tokens=len(ends),
        finish_reason=1,
        arrival_ns=ns(arrival),
        tokens=[1] * len(ends),
        index=list(range(len(ends))),
        worker=worker,
        t_received_ns=int(received * MS),
        t_scheduled_ns=int(prefill[0] * MS),
        t_step_start_ns=ns(starts),
        t_step_end_ns=ns(ends),
        t_front_recv_ns=ns(recv),
        t_send_ns=ns(recv),
        prefill_worker=prefill_worker,
        t_handoff_ns=int((prefill[1] + export_ms) * MS),
    )


def grid(first: float, step_ms: float, tokens: int) -> list[tuple[float, float]]:
    return [(first + i * step_ms, first + (i + 1) * step_ms) for i in range(tokens)]


def next_on_grid(t: float, step_ms: float) -> float:
    return -(-t // step_ms) * step_ms


def prefill_bound(export_ms: float = 2.0) -> list[RequestRecord]:
    """16 long prompts at once on one prefill worker that prefills 4 per 400 ms step, back to
    back; three decode workers step every 10 ms, taking each state at their next step."""
    records = []
    for k in range(16):
        start = 1.0 + 400.0 * (k // 4)
        end = start + 400.0
        first = next_on_grid(end + export_ms, 10.0)
        records.append(
            handed_off(
                k,
                received=1.0,
                prefill=(start, end),
                decode=(1 + k % 3, grid(first, 10.0, 20)),
                export_ms=export_ms,
            )
        )
    return records


def decode_bound() -> list[RequestRecord]:
    """32 prompts, one every 50 ms, each prefilled alone in a 10 ms step; the one decode
    worker steps every 60 ms back to back and takes each state three steps after it came."""
    records = []
    for k in range(32):
        start = 50.0 * k
        end = start + 10.0
        first = next_on_grid(end + 2.0, 60.0) + 120.0
        records.append(
            handed_off(k, received=start, prefill=(start, end), decode=(1, grid(first, 60.0, 30)))
        )
    return records


def healthy() -> list[RequestRecord]:
    """A prompt every 50 ms, prefilled alone in 20 ms, its state at the front 12 ms later;
    the decode worker takes it at its next 10 ms step. Each stream's gap across its
    hand-off is 28 ms, slow against the 10 ms of the others."""
    records = []
    for k in range(24):
        start = 50.0 * k
        end = start + 22.0
        first = next_on_grid(end + 12.0, 10.0)
        records.append(
            handed_off(
                k,
                received=start,
                prefill=(start, end),
                decode=(1, grid(first, 10.0, 30)),
                export_ms=12.0,
            )
        )
    return records


def result_of(records: list[RequestRecord], roles: dict[int, str] | None = None) -> BenchResult:
    return BenchResult(
        **msgspec.structs.asdict(summarize(records)),
        workers=worker_curves(records, {}, roles),
        records=records,
    )


def diagnosed(records: list[RequestRecord]) -> set[str]:
    return {f.rule for f in dx.diagnose(result_of(records))}


def test_each_curve_holds_its_workers_steps_in_its_role():
    curves = {w.worker: w for w in worker_curves(prefill_bound())}
    assert {w: c.role for w, c in curves.items()} == {
        0: "prefill",
        1: "decode",
        2: "decode",
        3: "decode",
    }
    prefill = curves[0]
    # The first tokens' steps are the prefill worker's, not their decode workers'.
    assert prefill.steps == 4 and prefill.sequences_per_step_p50 == 4
    assert prefill.step_ms_p50 == 400.0 and prefill.token_share == 16 / (16 * 21)
    assert prefill.itl_ms_p50 != prefill.itl_ms_p50  # no stream's gap is its own
    assert prefill.queue_ms_p50 == 600.0  # the median of 0, 400, 800, 1200 ms
    assert prefill.busy_share == 1.0  # four steps back to back
    for w in (1, 2, 3):
        assert curves[w].step_ms_p50 == 10.0
        # The gap across the hand-off is neither worker's: the decode worker's ITL is its step.
        assert curves[w].itl_ms_p50 == 10.0
        assert curves[w].busy_share < 0.6  # 200 ms of steps after each 400 ms prefill
    # The server's own worker specs win over what the timing says.
    given = worker_curves(prefill_bound(), {}, {0: "prefill", 1: "decode", 2: "decode"})
    assert [c.role for c in given] == ["prefill", "decode", "decode", msgspec.UNSET]


def test_a_colocated_run_has_no_roles():
    records = prefill_bound()
    for r in records:
        r.prefill_worker, r.t_handoff_ns = -1, 0
    assert all(c.role is msgspec.UNSET for c in worker_curves(records))
    assert not diagnosed(records) & POOL_RULES


def test_a_full_prefill_pool_is_named_with_its_advice():
    result = result_of(prefill_bound())
    findings = {f.rule: f for f in dx.diagnose(result)}
    assert dx.RULE_PREFILL_POOL_BOTTLENECK in findings, findings
    assert dx.RULE_DECODE_POOL_BOTTLENECK not in findings
    # The long admitting steps and the queue before them are the pool's: not named apart.
    assert dx.RULE_TTFT_ENGINE_START not in findings and dx.RULE_TTFT_QUEUEING not in findings
    finding = findings[dx.RULE_PREFILL_POOL_BOTTLENECK]
    ev = finding.evidence
    assert ev["prefill_workers"] == 1 and ev["decode_workers"] == 3
    assert ev["prefill_busy_share"] == 1.0 and ev["decode_busy_share"] < 0.6
    assert ev["prefill_queue_p50_ms"] == 600.0
    assert ev["ttft_tail_share"] >= 0.9
    assert "add prefill workers" in finding.look_at and "--disaggregate-above" in finding.look_at


def test_a_full_decode_pool_is_named_with_its_advice():
    records = decode_bound()
    result = result_of(records)
    findings = {f.rule: f for f in dx.diagnose(result)}
    assert dx.RULE_DECODE_POOL_BOTTLENECK in findings, findings
    assert dx.RULE_PREFILL_POOL_BOTTLENECK not in findings
    ev = findings[dx.RULE_DECODE_POOL_BOTTLENECK].evidence
    assert ev["decode_busy_share"] > 0.9 and ev["prefill_busy_share"] < 0.3
    assert ev["handoff_to_decode_p50_ms"] >= 2 * ev["decode_step_p50_ms"]
    # The slow gaps are the hand-offs', put on the decode pool; not the engine's slow steps.
    assert ev["itl_tail_share"] == 1.0
    assert dx.RULE_ITL_UNSTABLE_ENGINE not in findings
    assert "add decode workers" in findings[dx.RULE_DECODE_POOL_BOTTLENECK].look_at


def test_decode_steps_that_grow_with_their_batch_are_a_full_decode_pool():
    """The decode worker takes each state at once, but a step costs 10 ms plus 2 ms a
    sequence, and 32 streams pile up on it."""
    records = []
    t, steps = 0.0, []
    streams: list[tuple[int, float, list[tuple[float, float]]]] = []
    arrivals = [20.0 * k for k in range(32)]
    # Step the decode worker: a stream joins at its first step after its hand-off.
    pending = list(range(32))
    live: dict[int, list[tuple[float, float]]] = {}
    while pending or live:
        while pending and arrivals[pending[0]] + 17.0 <= t:
            live[pending.pop(0)] = []
        if not live:
            t = next_on_grid(arrivals[pending[0]] + 17.0, 1.0)
            continue
        step = (t, t + 10.0 + 2.0 * len(live))
        steps.append(step)
        for k in list(live):
            live[k].append(step)
            if len(live[k]) == 40:
                streams.append((k, arrivals[k], live.pop(k)))
        t = step[1]
    for k, start, decode in sorted(streams):
        records.append(
            handed_off(k, received=start, prefill=(start, start + 15.0), decode=(1, decode))
        )
    findings = {f.rule: f for f in dx.diagnose(result_of(records))}
    assert dx.RULE_DECODE_POOL_BOTTLENECK in findings, findings
    ev = findings[dx.RULE_DECODE_POOL_BOTTLENECK].evidence
    assert ev["decode_step_p50_ms"] >= 2 * ev["decode_step_one_sequence_ms"]
    assert dx.RULE_PREFILL_POOL_BOTTLENECK not in findings


def test_a_healthy_disaggregated_run_names_neither_pool_nor_its_handoffs():
    records = healthy()
    fired = diagnosed(records)
    assert not fired & POOL_RULES, fired
    # The gap across each hand-off (three steps) is the hand-off's, not the engine's, and
    # the two workers' different steps are their roles', not a slow card.
    assert not fired & {dx.RULE_ITL_UNSTABLE_ENGINE, dx.RULE_SLOW_WORKER}, fired
    tail = attribution(RunFacts(result_of(records)))
    assert tail is not None and len(tail.reads.slow) == 24
    assert tail.signature(SlowSteps) is None
    assert tail.itl_ms == {dx.RULE_DECODE_POOL_BOTTLENECK: tail.itl_total_ms}


def test_streams_prefilled_together_wait_for_their_handoffs_together_not_in_a_stall():
    """Each prefill step's four streams wait 80 ms for their states together, while no other
    stream is mid-stream: that is their hand-off, not a stall of every stream (a blocked
    front)."""
    records = prefill_bound(export_ms=80.0)
    assert timeline(records).stalls.shared == 0
    assert dx.RULE_FRONT_LOOP_BLOCKED not in diagnosed(records)


def test_long_prompts_on_a_prefill_worker_with_room_are_not_a_full_pool():
    """Each prompt takes a 400 ms prefill, slow first outputs all, but they come one a
    second: the prefill worker idles between them."""
    records = []
    for k in range(12):
        start = 1000.0 * k + 1.0
        end = start + 400.0
        first = next_on_grid(end + 2.0, 10.0)
        records.append(
            handed_off(k, received=start, prefill=(start, end), decode=(1, grid(first, 10.0, 30)))
        )
    result = result_of(records)
    assert result.workers[0].busy_share < 0.5
    assert not {f.rule for f in dx.diagnose(result)} & POOL_RULES
