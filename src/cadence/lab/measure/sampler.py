"""CPU per process (psutil), the whole host's CPU and card use (NVML) sampled during a run, on
a background thread, with the server's metrics page scraped every few samples."""

from __future__ import annotations

import os
import threading
import time

import psutil
from msgspec import UNSET, UnsetType

from cadence.lab.measure.prometheus import ScrapeError
from cadence.lab.measure.scrape import (
    LOOP_ON_TIME,
    LOOP_SAMPLES,
    SCRAPED_COUNTERS,
    SCRAPED_GAUGES,
    scrape,
)
from cadence.lab.measure.wakeups import WakeupProbe
from cadence.lab.results import (
    Gpu,
    HostCpu,
    OtherProcess,
    ProcessCpu,
    ScrapedFrontLoop,
    ServerMetrics,
    System,
)

OTHERS_KEPT = 3
"""The busiest other processes a run names."""
OTHER_MIN_PCT = 10.0
"""...each at least this % of a core over the sampled time."""


class SystemSampler:
    """Samples every watched process's CPU % (100 = one core) and every card's utilisation."""

    def __init__(
        self, interval_s: float = 0.1, metrics_url: str | None = None, scrape_every: int = 5
    ) -> None:
        self.interval_s = interval_s
        self._metrics_url = metrics_url
        self._scrape_every = scrape_every
        self._scrapes: list[tuple[float, dict[str, float]]] = []
        self._processes: dict[str, psutil.Process] = {}
        self._created: dict[str, float] = {}
        self._samples: dict[str, list[list[float]]] = {}
        self._gpu_samples: list[list[list[float]]] = []
        self._host_samples: list[tuple[float, float, float]] = []
        self._cpus = psutil.cpu_count() or 1
        self._lab = psutil.Process(os.getpid())
        self._cpu_times_at_start: dict[int, tuple[str, float]] = {}
        self._wakeups = WakeupProbe()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cadence-sampler", daemon=True)
        self._t0_ns = time.monotonic_ns()
        self._t0 = self._t0_ns / 1e9
        self._t0_wall = time.time()
        self._nvml = _open_nvml()

    def watch(self, name: str, pid: int) -> None:
        try:
            process = psutil.Process(pid)
            process.cpu_percent(None)  # the first call only sets the baseline
            created = process.create_time()
        except psutil.Error:
            return
        with self._lock:
            self._processes[name] = process
            self._created[name] = created
            self._samples.setdefault(name, [])

    def start(self) -> SystemSampler:
        self._t0_ns = time.monotonic_ns()
        self._t0 = self._t0_ns / 1e9
        self._t0_wall = time.time()
        psutil.cpu_percent(None)  # baselines
        self._lab.cpu_percent(None)
        self._cpu_times_at_start = _cpu_times()
        self._wakeups.start()
        self._thread.start()
        return self

    @property
    def started_ns(self) -> int:
        """`time.monotonic_ns()` at the zero of the samples' axis (set by `start`)."""
        return self._t0_ns

    def _run(self) -> None:
        ticks = 0
        self._scrape(0.0)
        while not self._stop.wait(self.interval_s):
            t = time.monotonic() - self._t0
            ticks += 1
            if ticks % self._scrape_every == 0:
                self._scrape(t)
            self._host_samples.append(
                (t, psutil.cpu_percent(None) * self._cpus, self._lab.cpu_percent(None))
            )
            with self._lock:
                watched = list(self._processes.items())
            for name, process in watched:
                try:
                    self._samples[name].append([t, process.cpu_percent(None)])
                except psutil.Error:
                    with self._lock:
                        self._processes.pop(name, None)
            if self._nvml is not None:
                for i, (util, mem_mb) in enumerate(_gpu_readings(self._nvml)):
                    while len(self._gpu_samples) <= i:
                        self._gpu_samples.append([])
                    self._gpu_samples[i].append([t, util, mem_mb])

    def _scrape(self, t: float) -> None:
        if self._metrics_url is None:
            return
        try:
            values = scrape(self._metrics_url)
        except ScrapeError:
            return  # a missed or unreadable scrape leaves a gap, nothing more
        if values:  # none: not a cadence server's page (another server of the protocol)
            self._scrapes.append((t, values))

    def _server_metrics(self) -> ServerMetrics | None:
        if not self._scrapes:
            return None
        first, last = self._scrapes[0][1], self._scrapes[-1][1]
        peaks: dict[str, float] = {}
        for _, values in self._scrapes:
            for key, value in values.items():
                if key.split("{")[0] in SCRAPED_GAUGES:
                    peaks[key] = max(peaks.get(key, value), value)
        return ServerMetrics(
            url=self._metrics_url,
            scrapes=len(self._scrapes),
            peaks=peaks,
            during_run={k: last.get(k, 0.0) - first.get(k, 0.0) for k in SCRAPED_COUNTERS},
            front_loop=self._front_loop(first, last),
            samples=list(self._scrapes),
        )

    @staticmethod
    def _front_loop(first: dict, last: dict) -> ScrapedFrontLoop | None:
        """The front's event-loop lag samples of the run, and how many came over 20 ms late."""
        if LOOP_SAMPLES not in last:
            return None  # a server that does not export it
        samples = last[LOOP_SAMPLES] - first.get(LOOP_SAMPLES, 0.0)
        on_time = last.get(LOOP_ON_TIME, 0.0) - first.get(LOOP_ON_TIME, 0.0)
        return ScrapedFrontLoop(samples=samples, late_over_20ms=samples - on_time)

    def _age_s(self, name: str) -> float | UnsetType:
        """How long process `name` had been running when sampling started; UNSET unknown."""
        created = self._created.get(name)
        return round(self._t0_wall - created, 3) if created is not None else UNSET

    def stop(self) -> System:
        """Stop sampling; the samples and their means and peaks. Its `flags` are left to the
        diagnosis (`cpu_busy_cards_idle`), which reads these samples."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._scrape(time.monotonic() - self._t0)
        processes = {}
        for name, samples in self._samples.items():
            values = [pct for _, pct in samples]
            processes[name] = ProcessCpu(
                pid=self._processes[name].pid if name in self._processes else None,
                cpu_pct_mean=sum(values) / len(values) if values else None,
                cpu_pct_max=max(values) if values else None,
                samples=[(t, pct) for t, pct in samples],
                age_s=self._age_s(name),
            )
        gpus = []
        for i, samples in enumerate(self._gpu_samples):
            utils = [u for _, u, _ in samples]
            gpus.append(
                Gpu(
                    index=i,
                    util_pct_mean=sum(utils) / len(utils) if utils else None,
                    util_pct_max=max(utils) if utils else None,
                    mem_used_mb_max=max((m for _, _, m in samples), default=None),
                    samples=[(t, u, m) for t, u, m in samples],
                )
            )
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
        return System(
            interval_s=self.interval_s,
            processes=processes,
            gpus=gpus,
            host=self._host(),
            server_metrics=self._server_metrics(),
        )

    def _host(self) -> HostCpu:
        busy = [pct for _, pct, _ in self._host_samples]
        others = self._others()  # while the probe, a child of the lab, still runs
        return HostCpu(
            cpus=self._cpus,
            busy_pct_mean=sum(busy) / len(busy) if busy else None,
            samples=self._host_samples,
            others=others,
            wakeups=self._wakeups.stop(),
        )

    def _others(self) -> list[OtherProcess]:
        """The busiest processes that are neither watched nor the lab, nor children of either
        (a server's engine processes, the load processes), by their CPU time over the run."""
        ours = {self._lab.pid}
        for process in [self._lab, *self._processes.values()]:
            try:
                ours.add(process.pid)
                ours.update(child.pid for child in process.children(recursive=True))
            except psutil.Error:
                continue
        wall_s = max(time.monotonic() - self._t0, 1e-3)
        others = []
        for pid, (name, cpu_s) in _cpu_times().items():
            then = self._cpu_times_at_start.get(pid)
            if pid in ours or then is None or then[0] != name:
                continue
            pct = 100 * (cpu_s - then[1]) / wall_s
            if pct >= OTHER_MIN_PCT:
                others.append(OtherProcess(pid=pid, name=name, cpu_pct=round(pct, 1)))
        return sorted(others, key=lambda o: o.cpu_pct, reverse=True)[:OTHERS_KEPT]


def _cpu_times() -> dict[int, tuple[str, float]]:
    """Every process's name and CPU seconds so far."""
    times = {}
    for process in psutil.process_iter(["name", "cpu_times"]):
        cpu = process.info["cpu_times"]
        if cpu is not None:
            times[process.pid] = (process.info["name"] or "?", cpu.user + cpu.system)
    return times


def _open_nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no nvidia-ml-py, no driver, no card: sample CPU only
        return None


def _gpu_readings(nvml) -> list[tuple[float, float]]:
    readings = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
        mem = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
        readings.append((float(util), float(mem)))
    return readings
