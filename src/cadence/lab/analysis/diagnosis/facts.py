"""What several rules read from a bench result, read once, and the yardsticks they share.

The yardstick for "high" and "unstable" is the run's own engine step (the p50 of the
``engine_step`` segment), not a fixed number of milliseconds: the same thresholds then hold
for a 5 ms synthetic step and a 40 ms step on a card.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TypeGuard

from cadence.lab.results import BenchResult, Distribution, FrontLoop, ScrapedFrontLoop

MIN_CPU_SAMPLES = 3
"""CPU readings come every 0.1 s with ~10 % resolution each; fewer than this many inside the
run are not evidence (nor are fewer steps of a worker)."""

ENGINE_UNSTABLE_P90_RATIO = 1.5
ENGINE_UNSTABLE_MIN_MS = 6.0
"""The engine's steps vary when their p90 is this many times their p50 and this many ms above
it. Late wake-ups on a busy machine stretch steps by a few ms whatever their length: synthetic
steps measure p90/p50 of 1.0-1.05 on an idle 2-core machine and, with another benchmark on the
same cores, up to 1.4 for 10 ms steps and 1.85 for 5 ms steps, at most 4.5 ms above the p50.
Jitter with a standard deviation of 80 % of a 10 ms step gives 1.9-2.5, 9-15 ms above the
p50."""


OTHERS_MIN_PCT = 50.0
"""Other work contends for the host when processes outside the server and the lab used this
% of a core or more while the run was going..."""
HOST_FULL_SPARE_CORES = 0.5
"""...and the host had less than this many cores to spare (busy above its cores minus this):
on a host with cores to spare, other work costs the server nothing."""


@dataclass(frozen=True)
class Contention:
    """The host's CPU while the run was going, % of one core: busy, and who used it."""

    cpus: int
    busy: float
    server: float
    client: float
    lab: float

    @property
    def others(self) -> float:
        """What the server, its children, the clients and the lab did not use: other work.
        Busy minus ours holds processes that came and went during the run (a build's
        compilers), which no per-process reading alone would catch."""
        return self.busy - self.server - self.client - self.lab


def steps_vary(p50: float, p90: float) -> bool:
    """The engine's steps vary (ENGINE_UNSTABLE_*)."""
    return p90 >= ENGINE_UNSTABLE_P90_RATIO * p50 and p90 - p50 >= ENGINE_UNSTABLE_MIN_MS


def finite(x: object) -> TypeGuard[float]:
    """`x` is a finite number (an int or a float, not a bool): a reading to compute with."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def rounded(x: float, digits: int = 2) -> float:
    return round(float(x), digits)


def usable(d: Distribution | None) -> Distribution | None:
    """`d` when it has values to reason about, else None."""
    return d if d and d.usable else None


class RunFacts:
    """The numbers several rules share, read once from a bench result."""

    def __init__(self, result: BenchResult) -> None:
        self.result = result
        segments, first = result.segments_ms or None, result.ttft_segments_ms or None
        self.ttft = usable(result.ttft_ms)
        self.itl = usable(result.itl_ms)
        self.gaps = usable(result.chunk_gap_ms)
        self.step = usable(segments.engine_step) if segments else None
        self.delay = usable(result.token_delay_ms or None)
        self.first_step = usable(first.first_step) if first else None
        self.workers = sorted(
            n for n in result.system.processes if n.startswith("worker") and ".rank" not in n
        )

    @property
    def typical_step(self) -> float | None:
        if self.step and self.step.p50 > 0:
            return self.step.p50
        return None

    def segment(self, name: str) -> Distribution | None:
        segments = self.result.segments_ms
        return usable(getattr(segments, name)) if segments else None

    def ttft_segment(self, name: str) -> Distribution | None:
        segments = self.result.ttft_segments_ms
        return usable(getattr(segments, name)) if segments else None

    def share(self, kind: str, name: str) -> float | None:
        """A segment's share of TTFT (`kind` "ttft") or of a token's path ("token")."""
        shares = self.result.segment_shares
        value = getattr(shares, kind).get(name) if shares else None
        return value if finite(value) else None

    def active_cpu(self, name: str) -> float | None:
        """Mean CPU % of process `name` while the run was going, or None without enough samples.

        The sampler starts before the client processes start, import and connect (a second or
        more on a small machine) and stops right after the last record, so the run is the last
        `wall_s` seconds of the samples; the means the sampler reports include that idle start.
        A sample at t covers the interval before t; it counts when most of that is in the run.
        """
        process = self.result.system.processes.get(name)
        return self.active_mean([(t, pct) for t, pct in process.samples] if process else [])

    def active_mean(self, samples: list[tuple[float, float]]) -> float | None:
        """The mean of sampler readings [(t, value)] while the run was going (see
        `active_cpu`), or None without enough of them."""
        wall_s = self.result.wall_s
        interval = self.result.system.interval_s
        interval = interval if finite(interval) and interval > 0 else 0.1
        if not samples or not finite(wall_s) or wall_s <= 0:
            return None
        start = samples[-1][0] - wall_s
        inside = [v for t, v in samples if t - interval / 2 >= start and finite(v)]
        if len(inside) < MIN_CPU_SAMPLES:
            return None
        return sum(inside) / len(inside)

    @cached_property
    def host_full(self) -> Contention | None:
        """The host's CPU when it had no core to spare while the run was going (busy above
        its cores minus HOST_FULL_SPARE_CORES), whoever used the cores: the server, the load's
        clients, the lab or other work; None when it had one, or the host was not sampled."""
        system = self.result.system
        host = system.host or None
        if host is None:
            return None
        busy = self.active_mean([(t, pct) for t, pct, _ in host.samples])
        lab = self.active_mean([(t, pct) for t, _, pct in host.samples])
        if busy is None or lab is None or busy < 100 * (host.cpus - HOST_FULL_SPARE_CORES):
            return None
        clients = [n for n in system.processes if n.startswith("client")]
        client = sum(self.active_cpu(n) or 0.0 for n in clients)
        sampled = sum(self.active_cpu(n) or 0.0 for n in system.processes if n not in clients)
        threads = self.result.server_threads or None
        # The server's thread reading holds its children too (a foreign server's engines).
        server = max(sampled, sum(p.cpu_pct for p in threads.processes) if threads else 0.0)
        return Contention(cpus=host.cpus, busy=busy, server=server, client=client, lab=lab)

    @property
    def contention(self) -> Contention | None:
        """The host's CPU when other work filled it (`host_full`, and others used
        OTHERS_MIN_PCT or more) while the run was going; None when it did not, or the host was
        not sampled."""
        full = self.host_full
        return full if full is not None and full.others >= OTHERS_MIN_PCT else None

    @property
    def host_wakeups(self) -> Distribution | None:
        """How late a sleeping thread woke during the run (ms, the wake-up probe), when other
        work filled the host (`contention`); else None. A thread of the server's may wake
        that late at each sleep, with no fault of its own."""
        host = self.result.system.host or None
        wakeups = host.wakeups if host is not None else None
        if wakeups is None or not wakeups.count or not finite(wakeups.max):
            return None
        return wakeups if self.contention is not None else None

    @property
    def host_late_ms(self) -> float | None:
        """The latest wake-up of `host_wakeups` (ms), or None."""
        wakeups = self.host_wakeups
        return wakeups.max if wakeups is not None else None

    def loop_lag(self) -> FrontLoop | ScrapedFrontLoop | None:
        """The front's loop lag over the run: from the timed streams' tallies, else from the
        scraped metrics (`--metrics-port`); None without."""
        found = self.result.front_loop
        if found is not None and found.samples:
            return found
        scraped = self.result.system.server_metrics
        if scraped is not None and scraped.front_loop is not None and scraped.front_loop.samples:
            return scraped.front_loop
        return None
