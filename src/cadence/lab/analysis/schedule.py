"""How well an open-loop client kept its schedule: the rate it was asked for, the rate it sent
at, and each request's lag (actual send time minus intended send time, on the unshifted
schedule).

The client is behind its schedule when more than a tenth of its requests went out later than
one mean gap between arrivals (1 / rate), or 10 ms when the gap is shorter: the arrivals the
server saw were then not the Poisson process the run claims, so its latencies belong to a
lower load. The causes are the client's (CPU, event loop), not the server's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.lab.percentile import distribution

if TYPE_CHECKING:
    from cadence.lab.records import ProcessResult

_LAG_FLOOR_MS = 10.0


def schedule(
    rate: float | None, processes: list[ProcessResult], open_loop: bool | None = None
) -> dict:
    """`offered_rate_per_s`, `achieved_rate_per_s`, `schedule_lag_ms` (a distribution) and
    `behind_schedule`, as fields of `results.Client`; the first three None in a closed loop
    (`open_loop` false; by default, open when a `rate` is given). `rate` is the offered rate
    (a trace's: its rows over its span; None when it has no span)."""
    if open_loop is None:
        open_loop = bool(rate)
    if not open_loop:
        return {
            "offered_rate_per_s": None,
            "achieved_rate_per_s": None,
            "schedule_lag_ms": None,
            "behind_schedule": False,
        }
    sends = [r.start_ns for p in processes for r in p.records]
    started = min(p.started_ns for p in processes)
    span_s = (max(sends) - started) / 1e9 if sends else 0.0
    lag = distribution(lag for p in processes for lag in p.schedule_lag_ms)
    return {
        "offered_rate_per_s": rate,
        "achieved_rate_per_s": len(sends) / span_s if span_s > 0 else None,
        "schedule_lag_ms": lag,
        "behind_schedule": lag.count > 0
        and lag.p90 > max(1e3 / rate if rate else 0.0, _LAG_FLOOR_MS),
    }
