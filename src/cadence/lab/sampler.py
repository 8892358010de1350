"""CPU per process (psutil) and card use (NVML) sampled during a run, on a background thread.

Point S10 of the design: collective communication and data movement also burn CPU, so the
lab watches CPU and card utilisation together and flags "CPU busy while the cards idle".
"""

from __future__ import annotations

import threading
import time

import psutil

_BUSY_CPU_PCT = 80.0
_IDLE_GPU_PCT = 30.0


def server_processes(target: str) -> dict[str, int]:
    """{"front": pid, "worker0": pid, ...} for a server listening on this host, else {}."""
    host, _, port = target.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "0.0.0.0", "[::1]", "::1"):
        return {}
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return {}
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == int(port) and conn.pid:
            front = psutil.Process(conn.pid)
            found = {"front": front.pid}
            for i, child in enumerate(sorted(front.children(), key=lambda p: p.pid)):
                found[f"worker{i}"] = child.pid
            return found
    return {}


class SystemSampler:
    """Samples every watched process's CPU % (100 = one core) and every card's utilisation."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self._processes: dict[str, psutil.Process] = {}
        self._samples: dict[str, list[list[float]]] = {}
        self._gpu_samples: list[list[list[float]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cadence-sampler", daemon=True)
        self._t0 = time.monotonic()
        self._nvml = _open_nvml()

    def watch(self, name: str, pid: int) -> None:
        try:
            process = psutil.Process(pid)
            process.cpu_percent(None)  # the first call only sets the baseline
        except psutil.Error:
            return
        with self._lock:
            self._processes[name] = process
            self._samples.setdefault(name, [])

    def start(self) -> SystemSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            t = time.monotonic() - self._t0
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

    def stop(self) -> dict:
        """Stop sampling; the samples and their means and peaks, plus the S10 flag."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        processes = {}
        for name, samples in self._samples.items():
            values = [pct for _, pct in samples]
            processes[name] = {
                "pid": self._processes[name].pid if name in self._processes else None,
                "cpu_pct_mean": sum(values) / len(values) if values else None,
                "cpu_pct_max": max(values) if values else None,
                "samples": samples,
            }
        gpus = []
        for i, samples in enumerate(self._gpu_samples):
            utils = [u for _, u, _ in samples]
            gpus.append({
                "index": i,
                "util_pct_mean": sum(utils) / len(utils) if utils else None,
                "util_pct_max": max(utils) if utils else None,
                "mem_used_mb_max": max((m for _, _, m in samples), default=None),
                "samples": samples,
            })
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
        return {"interval_s": self.interval_s, "processes": processes, "gpus": gpus,
                "flags": cpu_busy_cards_idle(processes, gpus)}


def cpu_busy_cards_idle(processes: dict, gpus: list[dict]) -> list[str]:
    """S10: a process near a full core while every card is mostly idle."""
    if not gpus or any((g["util_pct_mean"] or 0) >= _IDLE_GPU_PCT for g in gpus):
        return []
    busy = [n for n, p in processes.items() if (p["cpu_pct_mean"] or 0) >= _BUSY_CPU_PCT]
    if not busy:
        return []
    util = max(g["util_pct_mean"] or 0 for g in gpus)
    return [f"CPU busy while the cards idle: {', '.join(busy)} at >= {_BUSY_CPU_PCT:.0f}% of a "
            f"core, cards at most {util:.0f}% utilised"]


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
