"""Rules on a disaggregated server's two pools (`--prefill-devices`, `--decode-devices`):
`prefill_pool_bottleneck` (the first outputs wait for prefill workers that step back to
back, while the decode workers take each handed-off state at once) and
`decode_pool_bottleneck` (the decode workers step back to back with batches that slow their
steps, or the handed-off states wait for room on them).

Both read the workers' curves in their roles (`cadence.lab.analysis.worker_curves`), the
hand-off's segments and the tail time their causes claim (`signatures.PrefillPoolWait`: a
slow first output's time on its prefill worker; `signatures.HandOffGaps`: a stream's gap
across its hand-off). A server whose workers both prefill and decode has no roles, and
neither rule reads it.
"""

from __future__ import annotations

import statistics

from msgspec import UnsetType

from cadence.lab.analysis.diagnosis.coincidence import attribution
from cadence.lab.analysis.diagnosis.facts import MIN_CPU_SAMPLES, RunFacts, finite, rounded
from cadence.lab.analysis.diagnosis.names import (
    RULE_DECODE_POOL_BOTTLENECK,
    RULE_PREFILL_POOL_BOTTLENECK,
)
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.analysis.diagnosis.workers import step_model
from cadence.lab.results import Finding, WorkerCurve

POOL_BUSY_SHARE = 0.8
"""A pool is full when its workers' steps covered at least this share of their time (each
worker's own, from its first step to its last; the median over the pool): it stepped back
to back, and more work queues. A synthetic decode worker that always holds a stream covers
0.9-1.0; a prefill worker that long prompts keep busy now and then, 0.1-0.5; one prefill
worker taking 5 prompts of 1,500 tokens a second (0.1 ms a token), 0.88."""

PREFILL_TTFT_TAIL_SHARE = 0.5
"""The prefill pool holds TTFT back when the first outputs' time on prefill workers (their
wait and their prefill) is at least this share of the first outputs' tail."""

HANDOFF_WAIT_STEPS = 2.0
HANDOFF_WAIT_MIN_MS = 10.0
"""The handed-off states wait for room on the decode workers when, from the front's getting
one to the start of its first decode step, the p50 is this many decode steps and this many
ms: with room, a state waits for the step under way to end, under one step."""

DECODE_STEP_GROWTH = 2.0
DECODE_STEP_GROWTH_MIN_MS = 5.0
"""The decode workers' batches slow their steps when the step p50 is this many times, and this
many ms above, what their own steps' fit (a fixed cost plus a cost per sequence) gives for one
sequence: every stream's ITL grows with the batch."""


def _pool(facts: RunFacts, role: str) -> list[WorkerCurve]:
    return [
        w
        for w in facts.result.workers or []
        if w.role == role and w.steps >= MIN_CPU_SAMPLES and finite(w.busy_share)
    ]


def _median(values: list[float | UnsetType]) -> float | None:
    known = [v for v in values if finite(v)]
    return statistics.median(known) if known else None


def _to_decode_p50(facts: RunFacts) -> float | None:
    handoff = facts.result.handoff_segments_ms or None
    to_decode = handoff.to_decode if handoff else None
    return to_decode.p50 if to_decode is not None and to_decode.count else None


def _states_wait(decode: list[WorkerCurve], to_decode: float | None) -> bool:
    step = _median([w.step_ms_p50 for w in decode])
    return (
        to_decode is not None
        and step is not None
        and to_decode >= HANDOFF_WAIT_STEPS * step
        and to_decode >= HANDOFF_WAIT_MIN_MS
    )


def _one_sequence_step(decode: list[WorkerCurve]) -> float | None:
    """What the decode workers' steps take with one sequence, from their fit; None without
    one (their batches never varied)."""
    model = step_model(decode)
    return model[0] + model[1] if model is not None else None


def _pool_evidence(name: str, pool: list[WorkerCurve]) -> dict:
    return {
        f"{name}_workers": len(pool),
        f"{name}_busy_share": rounded(_median([w.busy_share for w in pool]) or 0.0, 3),
        f"{name}_step_p50_ms": rounded(_median([w.step_ms_p50 for w in pool]) or 0.0),
        f"{name}_sequences_per_step": rounded(
            _median([w.sequences_per_step_p50 for w in pool]) or 0.0, 1
        ),
    }


def prefill_pool_bottleneck(facts: RunFacts) -> list[Finding]:
    prefill, decode = _pool(facts, "prefill"), _pool(facts, "decode")
    tail = attribution(facts)
    if not prefill or not decode or tail is None:
        return []
    busy = _median([w.busy_share for w in prefill])
    share = tail.ttft_share(RULE_PREFILL_POOL_BOTTLENECK)
    to_decode = _to_decode_p50(facts)
    if busy is None or busy < POOL_BUSY_SHARE or share < PREFILL_TTFT_TAIL_SHARE:
        return []
    if _states_wait(decode, to_decode):
        return []  # the decode pool is short of room too: `decode_pool_bottleneck`
    queue = _median([w.queue_ms_p50 for w in prefill])
    evidence = {
        **_pool_evidence("prefill", prefill),
        **_pool_evidence("decode", decode),
        **tail.shares(RULE_PREFILL_POOL_BOTTLENECK),
    }
    if queue is not None:
        evidence["prefill_queue_p50_ms"] = rounded(queue)
    if to_decode is not None:
        evidence["handoff_to_decode_p50_ms"] = rounded(to_decode)
    if facts.ttft:
        evidence["ttft_p50_ms"] = rounded(facts.ttft.p50)
    waits = f" waiting {queue:.0f} ms at the median before their step" if queue else ""
    return [
        Finding(
            rule=RULE_PREFILL_POOL_BOTTLENECK,
            finding=(
                f"the prefill pool holds TTFT back: its {len(prefill)} worker(s) stepped "
                f"{busy:.0%} of the time, {evidence['prefill_sequences_per_step']:g} "
                f"prompt(s) a step, the first outputs made there{waits}, and their wait "
                f"and prefill are {share:.0%} of the first outputs' tail, while the "
                f"{len(decode)} decode worker(s) took each handed-off state at once"
            ),
            evidence=evidence,
            look_at=(
                "add prefill workers (--prefill-devices; a decode worker to spare can "
                "become one), or raise --disaggregate-above so that shorter prompts prefill "
                "on the decode workers, which have room"
            ),
        )
    ]


def decode_pool_bottleneck(facts: RunFacts) -> list[Finding]:
    prefill, decode = _pool(facts, "prefill"), _pool(facts, "decode")
    if not decode:
        return []
    busy = _median([w.busy_share for w in decode])
    if busy is None or busy < POOL_BUSY_SHARE:
        return []
    to_decode = _to_decode_p50(facts)
    waits = _states_wait(decode, to_decode)
    step = _median([w.step_ms_p50 for w in decode])
    alone = _one_sequence_step(decode)
    grown = (
        step is not None
        and alone is not None
        and alone > 0
        and step >= DECODE_STEP_GROWTH * alone
        and step - alone >= DECODE_STEP_GROWTH_MIN_MS
    )
    if not (waits or grown):
        return []
    evidence = {**_pool_evidence("decode", decode)}
    if prefill:
        evidence.update(_pool_evidence("prefill", prefill))
    if to_decode is not None:
        evidence["handoff_to_decode_p50_ms"] = rounded(to_decode)
    if alone is not None:
        evidence["decode_step_one_sequence_ms"] = rounded(alone)
    itl = _median([w.itl_ms_p50 for w in decode])
    if itl is not None:
        evidence["decode_streams_itl_p50_ms"] = rounded(itl)
    tail = attribution(facts)
    if tail is not None:
        evidence.update(tail.shares(RULE_DECODE_POOL_BOTTLENECK))
    parts = []
    if grown:
        parts.append(
            f"their batches of {evidence['decode_sequences_per_step']:g} sequences stretch a "
            f"step to {step:.1f} ms against {alone:.1f} ms for one, so every stream's ITL "
            f"grows (p50 {itl:.1f} ms)"
            if itl is not None
            else f"their batches stretch a step to {step:.1f} ms against {alone:.1f} ms for one"
        )
    if waits:
        share = evidence.get("itl_tail_share")
        parts.append(
            f"each handed-off state waits {to_decode:.0f} ms at the median for room on one"
            + (f" (the gaps across hand-offs: {share:.0%} of the gaps' tail)" if share else "")
        )
    idle = (
        f"; the {len(prefill)} prefill worker(s) stepped {evidence['prefill_busy_share']:.0%} of theirs"
        if prefill
        else ""
    )
    return [
        Finding(
            rule=RULE_DECODE_POOL_BOTTLENECK,
            finding=(
                f"the decode pool is full: its {len(decode)} worker(s) stepped {busy:.0%} of "
                f"the time, " + " and ".join(parts) + idle
            ),
            evidence=evidence,
            look_at=(
                "add decode workers (--decode-devices; a prefill worker to spare can become "
                "one), or lower --disaggregate-above so that the decode workers prefill fewer "
                "prompts themselves; a lower --max-batch trades their throughput for ITL"
            ),
        )
    ]


RULES = (
    Rule(RULE_PREFILL_POOL_BOTTLENECK, prefill_pool_bottleneck),
    Rule(RULE_DECODE_POOL_BOTTLENECK, decode_pool_bottleneck),
)
