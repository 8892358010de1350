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

Of that time, what admitting steps took running other streams' prefills is
`signatures.PrefillStalls`' (`prefill_waits`): a stream taken in by its worker's k-th
admitting step waited for the k-1 before it and for the others taken in with it.
"""

from __future__ import annotations

import bisect
import collections
import statistics

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


def _admitting(reads: Reads, within_ns: float) -> list[tuple[int, float]]:
    """Without the server's timing, the admitting steps the streams already receiving show:
    (end, ms beyond the stream's own pace) of each slow gap that ends within `within_ns` of
    another stream's first output, in time order."""
    found = []
    for g in reads.gaps:
        over = _slow_by(g.ms, g.tokens * (g.stream.speed_ms or reads.typical_ms))
        if over and reads.joined_at(g.t1, within_ns, g.stream.number)[0]:
            found.append((g.t1, over))
    return sorted(found)


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
    stalls_seen = Stalls(
        [(end - ms * NS_PER_MS, float(end)) for end, ms in _admitting(reads, admitting_within_ns)]
    )
    return {s.number: stalls_seen.within_ms(s.start_ns, s.first_ns) for s in reads.streams}


def prefill_waits(reads: Reads, admitting_within_ns: float) -> dict[int, float]:
    """Stream number → ms of its time to first output that admitting steps took beyond their
    pace running other streams' prefills (`signatures.PrefillStalls`): the whole of each
    admitting step it waited through before the one that took it in, and of that one the
    share of the other streams taken in with it; its own prefill is its own first cost.

    Against each worker's own pace (with the server's timing) or each stream's own (without),
    so a slower card's steps are not taken for prefills; a step that took no stream in is no
    prefill's, however long."""
    records = {s.number: s.record for s in reads.streams}
    spans: dict[int, list[tuple[float, float]]] = {}
    """Where (a worker, or 0 for the run without the timing) → its admitting steps' time
    beyond pace, (from, to) ns."""
    waits: dict[int, tuple[int, float, float, float, int]] = {}
    """Stream number → (where, from, to) it waited, its own step's time beyond pace (ms) and
    the streams that step took in."""
    if all(r.t_step_end_ns and r.t_received_ns for r in records.values()):
        steps: dict[int, dict[int, float]] = {}
        for r in records.values():
            for w, s0, s1 in zip(r.chunk_workers(), r.t_step_start_ns, r.t_step_end_ns):
                if s1:
                    steps.setdefault(w, {})[s1] = (s1 - s0) / NS_PER_MS
        pace = {w: statistics.median(by_end.values()) for w, by_end in steps.items()}
        taken_in = collections.Counter(
            (r.chunk_workers()[0], r.t_step_end_ns[0]) for r in records.values()
        )
        over = {(w, end): _slow_by(steps[w][end], pace[w]) for w, end in taken_in}
        for (w, end), ms in over.items():
            if ms:
                spans.setdefault(w, []).append((end - ms * NS_PER_MS, end))
        for n, r in records.items():
            step = (r.chunk_workers()[0], r.t_step_end_ns[0])
            waits[n] = (step[0], r.t_received_ns, step[1], over[step], taken_in[step])
    else:
        ends = _admitting(reads, admitting_within_ns)
        spans[0] = [(end - ms * NS_PER_MS, end) for end, ms in ends]
        for s in reads.streams:
            # Its own step ended where the other streams' slow gaps ended at its first output.
            k = bisect.bisect_left(ends, (s.first_ns - admitting_within_ns,))
            near = [ms for end, ms in ends[k:] if end <= s.first_ns + admitting_within_ns]
            taken = 1 + reads.joined_at(s.first_ns, admitting_within_ns, s.number)[0]
            waits[s.number] = (0, s.start_ns, s.first_ns, max(near, default=0.0), taken)
    stalls = {w: Stalls(v) for w, v in spans.items()}
    return {
        n: max(0.0, stalls[w].within_ms(lo, hi) - own / taken)
        for n, (w, lo, hi, own, taken) in waits.items()
        if w in stalls
    }
