"""Where a bad tail's slow values fall, from the client's records alone: when in the run, in
which streams, and what else was happening at the same instants.

A slow gap is a gap between two chunks of a stream whose ITL (the gap over the later chunk's
tokens) is above a bound; a slow first output is a request whose TTFT is above one. The
coincidences are set against chance: the streams sent during the slow gaps beside how many
the run's rate of sends would put in that much time, so a coincidence that any stretch of
the run would show reads as none. A slow gap during which other streams got output is the
stream's own delay; one during which none did is a stall of every stream.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from cadence.lab.percentile import percentile
from cadence.lab.records import RequestRecord

_NS_PER_MS = 1e6
_NS_PER_S = 1e9

MOMENT_S = 0.1
"""Slow values less than this far apart are one moment of the run."""
MOMENTS_SHOWN = 6
"""The first moments listed in `*_at_s`; the rest are counted."""
PARTS = 10
"""The run is cut in this many equal parts: `*_in_tenths` says in how many a slow value
fell (1: one moment of the run, 10: all along it)."""


class _Run:
    """The run's streams on one clock: starts, first outputs and ends, sorted."""

    def __init__(self, records: list[RequestRecord]) -> None:
        self.streams = [r for r in records if r.arrival_ns]
        self.t0 = min(r.start_ns for r in records)
        ends = [r.end_ns or (r.arrival_ns[-1] if r.arrival_ns else r.start_ns) for r in records]
        self.t1 = max(ends)
        self.starts = sorted(r.start_ns for r in records)
        self.ends = sorted(ends)
        self.arrivals = sorted(t for r in self.streams for t in r.arrival_ns)

    def received_during(self, a: int, b: int) -> bool:
        """Some stream got a chunk strictly between a and b (a gap's own stream got none)."""
        return bisect.bisect_right(self.arrivals, a) < bisect.bisect_left(self.arrivals, b)

    def open_at(self, t: int) -> int:
        """Streams sent and not ended at `t`."""
        return bisect.bisect_right(self.starts, t) - bisect.bisect_right(self.ends, t)

    def started_during(self, a: int, b: int) -> int:
        """Streams sent strictly between a and b."""
        return bisect.bisect_left(self.starts, b) - bisect.bisect_right(self.starts, a)

    def moments(self, times: Iterable[int]) -> tuple[str, int]:
        """`times` as moments of the run in seconds from its first send ("0.42-0.47 (16),
        1.20 (1)"), and in how many of its PARTS they fall."""
        ordered = sorted(times)
        groups: list[list[int]] = []
        for t in ordered:
            if groups and t - groups[-1][-1] <= MOMENT_S * _NS_PER_S:
                groups[-1].append(t)
            else:
                groups.append([t])
        words = []
        for g in groups[:MOMENTS_SHOWN]:
            a, b = (f"{(t - self.t0) / _NS_PER_S:.2f}" for t in (g[0], g[-1]))
            words.append((a if a == b else f"{a}-{b}") + f" ({len(g)})")
        if len(groups) > MOMENTS_SHOWN:
            words.append(f"and {len(groups) - MOMENTS_SHOWN} more moments")
        span = max(1, self.t1 - self.t0)
        parts = {min(PARTS - 1, (t - self.t0) * PARTS // span) for t in ordered}
        return ", ".join(words), len(parts)


def slow_gaps(records: list[RequestRecord], bound_ms: float) -> dict:
    """When the gaps with ITL above `bound_ms` fell, in which streams, and what coincided;
    {} without such a gap."""
    run = _Run(records)
    gaps: list[tuple[int, int, int]] = []
    """(previous arrival, arrival, stream) of every gap that carries tokens."""
    slow: list[tuple[int, int, int]] = []
    excess_ms = 0.0
    for k, r in enumerate(run.streams):
        arrival, tokens = r.arrival_ns, r.tokens
        for i in range(1, len(arrival)):
            if not tokens[i]:
                continue
            gap = (arrival[i - 1], arrival[i], k)
            gaps.append(gap)
            itl = (arrival[i] - arrival[i - 1]) / _NS_PER_MS / tokens[i]
            if itl > bound_ms:
                slow.append(gap)
                excess_ms += (itl - bound_ms) * tokens[i]
    if not slow:
        return {}
    streams = {k for _, _, k in slow}
    per_stream = max(sum(1 for _, _, k in slow if k == s) for s in streams)
    at, parts = run.moments(b for _, b, _ in slow)
    started = sum(run.started_during(a, b) for a, b, _ in slow)
    by_chance = sum(b - a for a, b, _ in slow) * len(run.starts) / max(1, run.t1 - run.t0)
    return {
        "slow_gaps": len(slow),
        "gaps": len(gaps),
        "slow_gap_share": round(len(slow) / len(gaps), 4),
        "slow_gap_time_over_bound_ms": round(excess_ms, 1),
        "slow_gaps_at_s": at,
        "slow_gaps_in_tenths_of_run": parts,
        "streams_with_slow_gaps": len(streams),
        "streams": len(run.streams),
        "streams_with_slow_gaps_share": round(len(streams) / len(run.streams), 3),
        "slow_gaps_in_one_stream_max": per_stream,
        "slow_gaps_others_received_share": round(
            sum(1 for a, b, _ in slow if run.received_during(a, b)) / len(slow), 3
        ),
        "streams_started_during_slow_gaps": started,
        "streams_started_by_chance": round(by_chance, 1),
        "open_streams_at_slow_gaps_p50": percentile(
            sorted(float(run.open_at(b)) for _, b, _ in slow), 50
        ),
        "open_streams_at_gaps_p50": percentile(
            sorted(float(run.open_at(b)) for _, b, _ in gaps), 50
        ),
    }


def slow_first_outputs(records: list[RequestRecord], bound_ms: float) -> dict:
    """When the requests with TTFT above `bound_ms` were sent, and how many streams were open
    then against the other requests; {} without such a request."""
    run = _Run(records)
    sent = [(r.start_ns, (r.arrival_ns[0] - r.start_ns) / _NS_PER_MS) for r in run.streams]
    slow = [t for t, ttft in sent if ttft > bound_ms]
    if not slow:
        return {}
    at, parts = run.moments(slow)
    return {
        "slow_first_outputs": len(slow),
        "requests_with_output": len(sent),
        "slow_first_outputs_sent_at_s": at,
        "slow_first_outputs_in_tenths_of_run": parts,
        "open_streams_at_slow_sends_p50": percentile(
            sorted(float(run.open_at(t)) for t in slow), 50
        ),
        "open_streams_at_sends_p50": percentile(sorted(float(run.open_at(t)) for t, _ in sent), 50),
    }
