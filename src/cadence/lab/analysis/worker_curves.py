"""Each card's output curve, from the chunks' server timing: per worker (or tensor-parallel
group), its steps over the run, how many of the run's sequences each step carried, and the
tokens it delivered.

Sizing a server by its cards means watching whether each card's output curve is smooth. A
chunk's timing names the worker that serves its stream and the engine step that
made its first token (start and end, on the server's monotonic clock), so the steps of each
worker are the distinct (start, end) pairs among its chunks, and a step's sequences are the
chunks it made. Only the bench's own streams are seen: a step that also served other clients'
sequences counts only this run's.
"""

from __future__ import annotations

import math
from collections import defaultdict

from cadence.lab.percentile import percentile
from cadence.lab.records import RequestRecord
from cadence.lab.results import WorkerCurve

_NS_PER_MS = 1e6
MAX_POINTS = 2000
"""Per worker, the series keeps at most this many steps (evenly thinned) for the plot."""


def worker_curves(
    records: list[RequestRecord], devices: dict[int, str] | None = None
) -> list[WorkerCurve] | None:
    """One entry per worker seen in the timing, in worker order; None without timing."""
    steps: dict[int, dict[tuple[int, int], int]] = defaultdict(dict)
    tokens: dict[int, int] = defaultdict(int)
    itl: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.worker < 0 or not r.t_step_start_ns:
            continue
        mine = steps[r.worker]
        for start, end, count in zip(r.t_step_start_ns, r.t_step_end_ns, r.tokens, strict=False):
            if end:
                mine[(start, end)] = mine.get((start, end), 0) + 1
            tokens[r.worker] += count
        arrival = r.arrival_ns
        itl[r.worker].extend(
            (arrival[i] - arrival[i - 1]) / _NS_PER_MS / r.tokens[i]
            for i in range(1, len(arrival))
            if r.tokens[i]
        )
    steps = {worker: mine for worker, mine in steps.items() if mine}
    if not steps:
        return None  # timing without step times (a server that only echoes the fields)
    t0 = min(start for mine in steps.values() for start, _ in mine)
    t1 = max(end for mine in steps.values() for _, end in mine)
    span_s = max((t1 - t0) / 1e9, 1e-9)
    total = sum(tokens.values()) or 1
    curves = []
    for worker in sorted(steps):
        ordered = sorted(steps[worker].items())
        ms = sorted((end - start) / _NS_PER_MS for (start, end), _ in ordered)
        seqs = sorted(float(n) for _, n in ordered)
        every = max(1, math.ceil(len(ordered) / MAX_POINTS))
        its = sorted(itl[worker])
        curves.append(
            WorkerCurve(
                worker=worker,
                device=(devices or {}).get(worker),
                steps=len(ordered),
                step_ms_p50=percentile(ms, 50),
                step_ms_p90=percentile(ms, 90),
                sequences_per_step_p50=percentile(seqs, 50),
                tokens_per_s=tokens[worker] / span_s,
                token_share=tokens[worker] / total,
                itl_ms_p50=percentile(its, 50),
                series=[
                    (round((start - t0) / 1e9, 4), round((end - start) / _NS_PER_MS, 3), n)
                    for (start, end), n in ordered[::every]
                ],
            )
        )
    return curves
