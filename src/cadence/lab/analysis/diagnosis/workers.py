"""Rules on the workers' output curves (`cadence.lab.analysis.worker_curves`): `slow_worker`
(one card much slower than the others would be at its batch)."""

from __future__ import annotations

import statistics

from cadence.lab.analysis.diagnosis.facts import MIN_CPU_SAMPLES, RunFacts, finite, rounded
from cadence.lab.analysis.diagnosis.names import RULE_SLOW_WORKER
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.results import Finding, WorkerCurve

SLOW_WORKER_RATIO = 1.5
SLOW_WORKER_MIN_MS = 3.0
"""A worker's steps are much slower than the others' when its step p50 is this many times
the median of theirs and this many ms above it (a busy 2-core host moves one worker's steps
by up to 1.4x for 10 ms steps; a card at a third of the others' speed gives 3x)."""

SLOW_WORKER_BATCH_RATIO = 2.0
"""...at its own batch: the others' steps, fitted as a fixed cost plus a cost per sequence,
say how long they would take with its sequences per step (a slow card's streams last longer,
so it holds more of them). Where the others' batches never varied (nothing to fit), only a
worker whose sequences per step are within this factor of the others' is compared."""

SLOW_WORKER_ITL_RATIO = 1.3
"""...and its streams are the slow ones: their ITL p50 this many times the other streams'."""


def step_model(workers: list[WorkerCurve]) -> tuple[float, float] | None:
    """(fixed ms, ms per sequence) of a step, fitted by least squares over every step of
    `workers`; None when their batches never varied."""
    points = [(n, ms) for w in workers for _, ms, n in w.series if n > 0 and finite(ms)]
    if len(points) < MIN_CPU_SAMPLES or len({n for n, _ in points}) < 2:
        return None
    mean_n = statistics.fmean(n for n, _ in points)
    mean_ms = statistics.fmean(ms for _, ms in points)
    var = sum((n - mean_n) ** 2 for n, _ in points)
    per_seq = max(0.0, sum((n - mean_n) * (ms - mean_ms) for n, ms in points) / var)
    return mean_ms - per_seq * mean_n, per_seq


def _expected_step(w: WorkerCurve, others: list[WorkerCurve]) -> float | None:
    """How long the others' steps would take with `w`'s sequences per step; None when that
    cannot be told (no model, and batches not comparable)."""
    model = step_model(others)
    if model is not None:
        fixed, per_seq = model
        return max(fixed + per_seq * w.sequences_per_step_p50, min(o.step_ms_p50 for o in others))
    batch = statistics.median(o.sequences_per_step_p50 for o in others)
    ratio = SLOW_WORKER_BATCH_RATIO
    if not batch / ratio <= w.sequences_per_step_p50 <= batch * ratio:
        return None
    return statistics.median(o.step_ms_p50 for o in others)


def slow_worker(facts: RunFacts) -> list[Finding]:
    workers = [
        w
        for w in facts.result.workers or []
        if finite(w.step_ms_p50) and finite(w.itl_ms_p50) and w.steps >= MIN_CPU_SAMPLES
    ]
    if len(workers) < 2:
        return []
    findings = []
    for w in workers:
        # A disaggregated server's prefill and decode workers run different steps: each is
        # set against its own pool.
        others = [o for o in workers if o is not w and o.role == w.role]
        if not others:
            continue
        step = _expected_step(w, others)
        batch = statistics.median(o.sequences_per_step_p50 for o in others)
        itl = statistics.median(o.itl_ms_p50 for o in others)
        if step is None or not (
            w.step_ms_p50 >= SLOW_WORKER_RATIO * step
            and w.step_ms_p50 - step >= SLOW_WORKER_MIN_MS
            and w.itl_ms_p50 >= SLOW_WORKER_ITL_RATIO * itl
        ):
            continue
        name = f"worker {w.worker}" + (f" ({w.device})" if w.device else "")
        evidence: dict = {
            "worker": w.worker,
            "device": w.device,
            "step_p50_ms": rounded(w.step_ms_p50),
            "others_step_at_its_batch_ms": rounded(step),
            "sequences_per_step": rounded(w.sequences_per_step_p50, 1),
            "others_sequences_per_step": rounded(batch, 1),
            "its_streams_itl_p50_ms": rounded(w.itl_ms_p50),
            "other_streams_itl_p50_ms": rounded(itl),
            "token_share": rounded(w.token_share, 3),
        }
        cpu = facts.active_cpu(f"worker{w.worker}")
        if cpu is not None:
            evidence[f"worker{w.worker}_cpu_pct"] = rounded(cpu, 1)
        findings.append(
            Finding(
                rule=RULE_SLOW_WORKER,
                finding=(
                    f"{name} steps in {w.step_ms_p50:.1f} ms at p50 with "
                    f"{w.sequences_per_step_p50:.0f} sequences per step, where the others "
                    f"would take {step:.1f} ms with as many, and the streams "
                    f"it serves get a token every {w.itl_ms_p50:.1f} ms against "
                    f"{itl:.1f} ms: one card is slow, not the engine as a whole"
                ),
                evidence=evidence,
                look_at=(
                    f"that card: its clocks and temperature, other jobs on it, its PCIe / "
                    f"NVLink, the host CPU of its process (worker{w.worker}); then the "
                    "router, which gives it as many streams as the others"
                ),
            )
        )
    return findings


RULES = (Rule(RULE_SLOW_WORKER, slow_worker),)
