"""A run's own noise floor: how much later than the engine made it a token may reach the
client's clock on this host, in this run, with no fault anywhere. The verdict's ITL bound
adds it (`cadence.lab.analysis.tail_bound.itl_bound`), so a 3 ms step is judged by what the host
can deliver and not by a fixed number of milliseconds.

Its terms, each from where the run measured it:

- the timers' resolution: an event loop's timer waits in epoll's whole milliseconds, so a
  step, a flush or a read paced by one ends up to TIMER_RESOLUTION_MS late on any host;
- the host's wake-up lateness: the run's wake-up probe (`cadence.lab.measure.wakeups`) keeps
  how late a sleeping thread woke during the run; a token's way wakes HOPS threads (the
  engine's step, the front's loop, the client's read), each of which may wake that late: HOPS
  x the probe's p99;
- the client's read lag: how late the lab's own load loop acted on an event that was due:
  its loops' timer ticks' lateness (`client.loop_lag_ms`, p99; a result from before it was
  kept: an open loop's sends' lateness to their schedule, `client.schedule_lag_ms`). A client
  that fell behind its schedule is left out: its finding (`client_behind_schedule`) explains
  the tail instead.

A term the run did not measure (a result from before the probe or the ticks) adds nothing
and the line says so.
"""

from __future__ import annotations

import math
from typing import TypeGuard

import msgspec

from cadence.lab.results import BenchResult, Distribution

HOPS = 3
"""A token's way wakes three threads, each of which the host may wake late: the engine's step,
the front's loop, the client's read."""

TIMER_RESOLUTION_MS = 1.0
"""An event loop's timer ends up to this late: asyncio waits in epoll's whole milliseconds."""


class NoiseFloor(msgspec.Struct, kw_only=True):
    """The noise floor's terms (ms) and where each came from, in words."""

    terms_ms: dict[str, float]
    """Each term's part: `timer_resolution`, `host_wakeups`, `client_read_lag` (those measured)."""
    words: list[str]
    """Each term as the verdict line states it, unmeasured ones included."""

    @property
    def ms(self) -> float:
        return sum(self.terms_ms.values())

    def describe(self) -> str:
        return f"noise {self.ms:.1f} ms: " + " + ".join(self.words)


def noise_floor(result: BenchResult) -> NoiseFloor:
    """The run's noise floor, from what it measured."""
    terms = {"timer_resolution": TIMER_RESOLUTION_MS}
    words = [f"timer {TIMER_RESOLUTION_MS:g} ms (epoll's milliseconds)"]
    host = result.system.host or None
    wakeups = host.wakeups if host is not None else None
    if _usable(wakeups):
        terms["host_wakeups"] = HOPS * wakeups.p99
        words.append(f"{HOPS} x wake-up p99 {wakeups.p99:.1f} ms (the run's wake-up probe)")
    else:
        words.append("host wake-ups not measured")
    client = result.client
    ticks, sends = client.loop_lag_ms or None, client.schedule_lag_ms or None
    if client.behind_schedule is True:
        words.append("client read lag left out (it fell behind its schedule)")
    elif _usable(ticks):
        terms["client_read_lag"] = ticks.p99
        words.append(f"client loop lag p99 {ticks.p99:.1f} ms (its loop's timer)")
    elif _usable(sends):
        terms["client_read_lag"] = sends.p99
        words.append(f"client lag p99 {sends.p99:.1f} ms (its open-loop sends)")
    else:
        words.append("client read lag not measured")
    return NoiseFloor(terms_ms={k: round(v, 3) for k, v in terms.items()}, words=words)


def _usable(d: Distribution | None) -> TypeGuard[Distribution]:
    return d is not None and d.count > 0 and math.isfinite(d.p99)
