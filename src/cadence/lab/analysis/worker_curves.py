"""Each card's output curve, from the chunks' server timing: per worker (or tensor-parallel
group), its steps over the run, how many of the run's sequences each step carried, and the
tokens it delivered.

Sizing a server by its cards means watching whether each card's output curve is smooth. A
chunk's timing names the worker that serves its stream and the engine step that
made its first token (start and end, on the server's monotonic clock), so the steps of each
worker are the distinct (start, end) pairs among its chunks, and a step's sequences are the
chunks it made. Only the bench's own streams are seen: a step that also served other clients'
sequences counts only this run's.

Disaggregated serving (`--prefill-devices`): a handed-off stream's first chunk is its prefill
worker's (the step that made it ran there, before the front got the state) and the rest are
its decode worker's; each curve carries its worker's role, from the server's own worker specs
where the lab found them on this host, else from the timing (a worker that prefilled a
handed-off stream is a prefill worker, and every other worker of that server decodes).
"""

from __future__ import annotations

import math
from collections import defaultdict

from cadence.lab.percentile import percentile
from cadence.lab.records import RequestRecord
from cadence.lab.results import UNSET, WorkerCurve

_NS_PER_MS = 1e6
MAX_POINTS = 2000
"""Per worker, the series keeps at most this many steps (evenly thinned) for the plot."""


def curve_roles(
    records: list[RequestRecord], given: dict[int, str] | None = None
) -> dict[int, str]:
    """Each worker's role in disaggregated serving ("prefill" or "decode"): `given` (the
    server's worker specs) where it names any, else read from the timing; {} for a server
    whose workers both prefill and decode."""
    if given:
        return {w: role for w, role in given.items() if role}
    prefill = {r.prefill_worker for r in records if r.prefill_worker >= 0}
    if not prefill:
        return {}
    seen = {w for r in records for w in r.chunk_workers() if w >= 0}
    return {w: "prefill" if w in prefill else "decode" for w in seen | prefill}


def worker_curves(
    records: list[RequestRecord],
    devices: dict[int, str] | None = None,
    roles: dict[int, str] | None = None,
) -> list[WorkerCurve] | None:
    """One entry per worker seen in the timing, in worker order; None without timing.
    `roles`: each worker's role as the server's specs give it (see `curve_roles`)."""
    steps: dict[int, dict[tuple[int, int], int]] = defaultdict(dict)
    tokens: dict[int, int] = defaultdict(int)
    itl: dict[int, list[float]] = defaultdict(list)
    queue: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.worker < 0 or not r.t_step_start_ns:
            continue
        workers = r.chunk_workers()
        for worker, start, end, count in zip(
            workers, r.t_step_start_ns, r.t_step_end_ns, r.tokens, strict=False
        ):
            if end:
                mine = steps[worker]
                mine[(start, end)] = mine.get((start, end), 0) + 1
            tokens[worker] += count
        if r.t_received_ns and r.t_scheduled_ns >= r.t_received_ns:
            queue[workers[0]].append((r.t_scheduled_ns - r.t_received_ns) / _NS_PER_MS)
        arrival = r.arrival_ns
        # A gap counts for its chunk's worker; the one across a hand-off is neither's step.
        for i in range(1, min(len(arrival), len(workers))):
            if r.tokens[i] and workers[i] == workers[i - 1]:
                itl[workers[i]].append((arrival[i] - arrival[i - 1]) / _NS_PER_MS / r.tokens[i])
    steps = {worker: mine for worker, mine in steps.items() if mine}
    if not steps:
        return None  # timing without step times (a server that only echoes the fields)
    t0 = min(start for mine in steps.values() for start, _ in mine)
    t1 = max(end for mine in steps.values() for _, end in mine)
    span_s = max((t1 - t0) / 1e9, 1e-9)
    total = sum(tokens.values()) or 1
    role_of = curve_roles(records, roles)
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
                role=role_of.get(worker, UNSET),
                steps=len(ordered),
                step_ms_p50=percentile(ms, 50),
                step_ms_p90=percentile(ms, 90),
                sequences_per_step_p50=percentile(seqs, 50),
                tokens_per_s=tokens[worker] / span_s,
                token_share=tokens[worker] / total,
                itl_ms_p50=percentile(its, 50),
                busy_share=_busy_share(ordered, ms),
                queue_ms_p50=percentile(sorted(queue[worker]), 50),
                series=[
                    (round((start - t0) / 1e9, 4), round((end - start) / _NS_PER_MS, 3), n)
                    for (start, end), n in ordered[::every]
                ],
            )
        )
    return curves


def _busy_share(ordered: list[tuple[tuple[int, int], int]], ms: list[float]) -> float:
    """The worker's steps' time over its own span, from its first step's start to its last
    step's end: a worker that stepped back to back while it had work is near 1, whatever
    the run did before it started and after it ended (a prefill pool is done before the
    decode workers' last streams end)."""
    first, last = ordered[0][0][0], max(end for (_, end), _ in ordered)
    return min(1.0, sum(ms) * _NS_PER_MS / (last - first)) if last > first else 1.0
