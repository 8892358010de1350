"""What the streams' arrival times say taken together: evidence from client timestamps alone.

A service measured from outside gives no server timing, but many streams run at once, and
when they are read together their arrival times say where a delay comes from:

- `stalls`: a *shared stall* is a stretch longer than a stall in which no open stream got
  anything although at least two were mid-stream. Every stream stalled at the same instant,
  so the cause is on the server's side of the streams (a blocked event loop, a pool that all
  streams wait on, a collection pause, a stalled engine), not any one stream's. A long gap of
  one stream that no shared stall covers is that stream's own. A stream a disaggregated server
  hands off is mid-stream from its decode worker's first output (server timing).
- `bursts`: requests opened at once (starts chained less than `BURST_CHAIN_MS` apart) and how
  their times to first output spread: a server that takes calls in one at a time, or has one
  thread per stream, serves the first of a burst at once and the last much later.
- `concurrency`: how many streams were open (sent, not ended) and how many were receiving
  (first output seen, not ended) at most, and for what share of the run the receiving count
  sat at its peak while others waited: a hard cap (threads, max concurrent streams) holds the
  receiving count flat at its limit.

A stall is a gap of more than `STALL_GAP_FACTOR` typical gaps (the run's chunk-gap p50) and
`STALL_MIN_MS` more than it.
"""

from __future__ import annotations

import bisect
import math

from cadence.lab.percentile import percentile
from cadence.lab.records import RequestRecord
from cadence.lab.results import Bursts, Stalls, StreamConcurrency, Timeline

_NS_PER_MS = 1e6

STALL_GAP_FACTOR = 4.0
"""A gap is a stall from this many typical gaps: uneven but healthy delivery (a step 3x as
long as usual under heavy jitter) stays below it."""

STALL_MIN_MS = 20.0
"""...and from this many ms above the typical gap: with sub-millisecond gaps a scheduler
hiccup of a few ms would otherwise count."""

BURST_CHAIN_MS = 2.0
"""Requests whose starts follow each other closer than this belong to one burst (a load
process opens its closed-loop streams within ~0.2 ms of each other)."""

MIN_BURST = 8
"""Bursts smaller than this say little about how TTFT grows with streams opened at once."""


def timeline(records: list[RequestRecord]) -> Timeline | None:
    """The three pieces of evidence above; None without two streams that got output."""
    streams = [r for r in records if r.arrival_ns]
    gaps = sorted(
        (b - a) / _NS_PER_MS for r in streams for a, b in zip(r.arrival_ns, r.arrival_ns[1:])
    )
    if len(streams) < 2 or not gaps:
        return None
    typical = percentile(gaps, 50)
    threshold = max(STALL_GAP_FACTOR * typical, typical + STALL_MIN_MS)
    return Timeline(
        gap_p50_ms=typical,
        stall_threshold_ms=threshold,
        stalls=_stalls(streams, threshold, len(gaps)),
        bursts=_bursts(streams),
        concurrency=_concurrency(records),
    )


def _stalls(streams: list[RequestRecord], threshold_ms: float, gap_count: int) -> Stalls:
    limit = threshold_ms * _NS_PER_MS
    merged = sorted(t for r in streams for t in r.arrival_ns)
    firsts = sorted(_streaming_from(r) for r in streams)
    lasts = sorted(r.arrival_ns[-1] for r in streams)
    starts_waiting = sorted((r.start_ns, r.arrival_ns[0]) for r in streams)
    shared: list[tuple[int, int, int]] = []
    """(start, end, streams hit) of every shared stall."""
    for t0, t1 in zip(merged, merged[1:]):
        if t1 - t0 <= limit:
            continue
        # Mid-stream across the silence: a chunk at or before t0 and one at or after t1.
        # No chunk falls inside the silence, so a stream's last chunk before t1 is <= t0.
        mid = bisect.bisect_right(firsts, t0) - bisect.bisect_right(lasts, t0)
        if mid < 2:
            continue
        waiting = sum(1 for s, f in starts_waiting if s <= t0 and f >= t1)
        shared.append((t0, t1, mid + waiting))
    long_gaps = in_shared = 0
    stall_starts = [s for s, _, _ in shared]
    for r in streams:
        for a, b in zip(r.arrival_ns, r.arrival_ns[1:]):
            if b - a <= limit:
                continue
            long_gaps += 1
            k = bisect.bisect_left(stall_starts, a)
            if k < len(shared) and shared[k][1] <= b:
                in_shared += 1
    span_ns = merged[-1] - merged[0]
    lengths = sorted((t1 - t0) / _NS_PER_MS for t0, t1, _ in shared)
    hit = sorted(n for _, _, n in shared)
    return Stalls(
        shared=len(shared),
        shared_ms_p50=percentile(lengths, 50),
        shared_ms_max=lengths[-1] if lengths else math.nan,
        shared_time_share=sum(lengths) * _NS_PER_MS / span_ns if span_ns else 0.0,
        streams_hit_min=hit[0] if hit else 0,
        streams_hit_p50=percentile([float(n) for n in hit], 50),
        gaps=gap_count,
        long_gaps=long_gaps,
        long_gaps_in_shared=in_shared,
    )


def _streaming_from(r: RequestRecord) -> int:
    """When the stream began to stream: its first output, or for one a disaggregated server
    handed off (with timing), its decode worker's first, so that a stream is not mid-stream
    across its hand-off (the streams prefilled in one step wait for theirs together)."""
    if r.prefill_worker < 0:
        return r.arrival_ns[0]
    made_by = r.chunk_workers()
    k = next((k for k, w in enumerate(made_by) if w == r.worker), len(r.arrival_ns) - 1)
    return r.arrival_ns[min(k, len(r.arrival_ns) - 1)]


def _bursts(streams: list[RequestRecord]) -> Bursts:
    """The largest burst of requests opened at once, and how its TTFTs spread."""
    by_start = sorted(streams, key=lambda r: r.start_ns)
    best: list[RequestRecord] = []
    current = by_start[:1]
    for prev, r in zip(by_start, by_start[1:]):
        if r.start_ns - prev.start_ns <= BURST_CHAIN_MS * _NS_PER_MS:
            current.append(r)
        else:
            current = [r]
        if len(current) > len(best):
            best = list(current)
    ttft = sorted((r.arrival_ns[0] - r.start_ns) / _NS_PER_MS for r in best)
    alone = sorted((r.arrival_ns[0] - r.start_ns) / _NS_PER_MS for r in _alone(by_start))
    return Bursts(
        largest=len(best),
        ttft_p10_ms=percentile(ttft, 10),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_max_ms=ttft[-1] if ttft else math.nan,
        opened_alone=len(alone),
        alone_ttft_p50_ms=percentile(alone, 50),
    )


def _alone(by_start: list[RequestRecord]) -> list[RequestRecord]:
    """Requests with no other start within BURST_CHAIN_MS either side."""
    chain = BURST_CHAIN_MS * _NS_PER_MS
    out = []
    for k, r in enumerate(by_start):
        before = k > 0 and r.start_ns - by_start[k - 1].start_ns <= chain
        after = k + 1 < len(by_start) and by_start[k + 1].start_ns - r.start_ns <= chain
        if not (before or after):
            out.append(r)
    return out


def _concurrency(records: list[RequestRecord]) -> StreamConcurrency:
    """Peak open and receiving streams, and the share of the run the receiving count held its
    peak while at least one stream waited for its first output."""
    events: list[tuple[int, int, int]] = []
    """(time, change in open, change in receiving); ends sort before starts at one instant."""
    for r in records:
        end = r.end_ns or (r.arrival_ns[-1] if r.arrival_ns else r.start_ns)
        events.append((r.start_ns, 1, 0))
        events.append((end, -1, -1 if r.arrival_ns else 0))
        if r.arrival_ns:
            events.append((r.arrival_ns[0], 0, 1))
    events.sort(key=lambda e: (e[0], e[1] + e[2]))
    open_, receiving = 0, 0
    peak_open = peak_receiving = 0
    steps: list[tuple[int, int, int]] = []
    for t, d_open, d_receiving in events:
        open_ += d_open
        receiving += d_receiving
        peak_open = max(peak_open, open_)
        peak_receiving = max(peak_receiving, receiving)
        steps.append((t, open_, receiving))
    at_peak_waiting = 0
    for (t, open_, receiving), (t_next, _, _) in zip(steps, steps[1:]):
        if receiving == peak_receiving and open_ > receiving:
            at_peak_waiting += t_next - t
    span = steps[-1][0] - steps[0][0] if steps else 0
    return StreamConcurrency(
        peak_open=peak_open,
        peak_receiving=peak_receiving,
        capped_share=at_peak_waiting / span if span else 0.0,
    )
