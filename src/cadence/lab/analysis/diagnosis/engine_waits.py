"""How much of each stream's wait for its first output the engine's own steps took beyond
their pace: the part of a burst's spread of first outputs that long steps made, which
`signatures.BurstSpread` (call set-up, streams taken in one at a time) leaves to them.

With the server's timing (cadence's chunk Timing) each worker's steps are known: a stream
waited on its worker from the front's receiving it to the end of the step that made its
first output, and the time beyond a typical step of the steps it waited through there (the
prefills they ran, a slower card's pace) is the engine's. What it waited before the front
received it, and through steps of a normal length that did not take it in, is admission's.

Without it the streams already receiving show the steps, where admitting steps are long
(`signatures.PrefillStalls`): another stream's slow gap that ends where new streams got
their first output is an admitting step, and what it took beyond that stream's own pace is
the engine's, for every stream that waited meanwhile (which worker a stream waited on is
not known without the timing).
"""

from __future__ import annotations

import bisect

from cadence.lab.analysis.diagnosis.reads import NS_PER_MS, SLOW_GAP_MS, SLOW_GAP_RATIO, Reads


class Stalls:
    """Disjoint stretches of time (ns) in which an engine stepped beyond its pace."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        merged: list[list[float]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = [lo for lo, _ in merged]
        self.ends = [hi for _, hi in merged]

    def within_ms(self, lo: float, hi: float) -> float:
        """How much of (lo, hi) the stretches cover, in ms."""
        covered = 0.0
        k = bisect.bisect_right(self.ends, lo)
        while k < len(self.starts) and self.starts[k] < hi:
            covered += min(self.ends[k], hi) - max(self.starts[k], lo)
            k += 1
        return covered / NS_PER_MS


def _slow_by(ms: float, typical_ms: float) -> float:
    """What a step (or a gap) of `ms` took beyond `typical_ms` when it is slow by the reads'
    bound (`reads.SLOW_GAP_RATIO`, `reads.SLOW_GAP_MS`): jitter of normal steps is no stall."""
    return ms - typical_ms if ms > SLOW_GAP_RATIO * typical_ms + SLOW_GAP_MS else 0.0


def engine_waits(
    reads: Reads, typical_step_ms: float | None, admitting_within_ns: float | None
) -> dict[int, float]:
    """Stream number → ms of its time to first output that the engine's steps took beyond
    their pace; empty when the run shows neither the steps (server timing) nor long
    admitting steps. `admitting_within_ns`: where admitting steps are long, how close a gap's
    end and a first output are to be one step's outputs; None where they are not."""
    records = {s.number: s.record for s in reads.streams}
    timed = all(r.t_step_end_ns and r.t_received_ns for r in records.values())
    if timed and typical_step_ms:
        per_worker: dict[int, list[tuple[float, float]]] = {}
        for r in records.values():
            for w, s0, s1 in zip(r.chunk_workers(), r.t_step_start_ns, r.t_step_end_ns):
                over = _slow_by((s1 - s0) / NS_PER_MS, typical_step_ms) if s1 else 0.0
                if over:
                    per_worker.setdefault(w, []).append((s1 - over * NS_PER_MS, s1))
        stalls = {w: Stalls(spans) for w, spans in per_worker.items()}
        out = {}
        for n, r in records.items():
            on = stalls.get(r.chunk_workers()[0])
            out[n] = on.within_ms(r.t_received_ns, r.t_step_end_ns[0]) if on else 0.0
        return out
    if admitting_within_ns is None:
        return {}
    spans = []
    for g in reads.gaps:
        over = _slow_by(g.ms, g.tokens * (g.stream.speed_ms or reads.typical_ms))
        if over and reads.joined_at(g.t1, admitting_within_ns, g.stream.number)[0]:
            spans.append((g.t1 - over * NS_PER_MS, float(g.t1)))
    stalls_seen = Stalls(spans)
    return {s.number: stalls_seen.within_ms(s.start_ns, s.first_ns) for s in reads.streams}
