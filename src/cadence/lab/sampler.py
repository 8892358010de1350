"""CPU per process (psutil) and card use (NVML) sampled during a run, on a background thread.

Point S10 of the design: collective communication and data movement also burn CPU, so the
lab watches CPU and card utilisation together and flags "CPU busy while the cards idle".
"""

from __future__ import annotations

import http.client
import threading
import time

import psutil

_BUSY_CPU_PCT = 80.0
_IDLE_GPU_PCT = 30.0


_FRONT_CHILD = "cadence.lifecycle.front_child"
"""The module fronts 1..N-1 of `cadence serve --fronts N` run as (children of front 0)."""


def server_processes(target: str) -> dict[str, int]:
    """The processes of a server listening on this host, else {}.

    One front: {"front": pid, "worker0": pid, ...}. With `--fronts N` every front listens on
    the port (SO_REUSEPORT), so the first listener may be any of them: this finds front 0
    (the one that launched the workers and the other fronts) and returns {"front0": pid,
    "front1": pid, ..., "worker0": pid, ...}. A worker is named by its index; the other
    ranks of a tensor-parallel group as "worker{index}.rank{rank}".
    """
    front = _front_zero(target)
    if front is None:
        return {}
    fronts: dict[int, int] = {}
    workers = []
    for child in sorted(front.children(), key=lambda p: p.pid):
        k = _front_index(child)
        if k is None:
            workers.append(child)
        else:
            fronts[k] = child.pid
    if fronts:
        found = {"front0": front.pid, **{f"front{k}": fronts[k] for k in sorted(fronts)}}
    else:
        found = {"front": front.pid}
    for i, child in enumerate(workers):
        spec = _worker_spec(child)
        if spec is None:
            found[f"worker{i}"] = child.pid
        else:
            index, rank, _ = spec
            found[f"worker{index}" + (f".rank{rank}" if rank else "")] = child.pid
    return found


def _worker_spec(process: psutil.Process) -> tuple[int, int, str] | None:
    """(index, rank, device) of a `python -m cadence.worker SPEC` process, else None."""
    import json

    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return None
    if "cadence.worker" not in cmdline or not cmdline[-1].startswith("{"):
        return None
    try:
        spec = json.loads(cmdline[-1])
        return int(spec["index"]), int(spec.get("rank", 0)), str(spec["device"])
    except (ValueError, KeyError, TypeError):
        return None


def worker_devices(target: str) -> dict[int, str]:
    """{worker index: its device(s)} of a cadence server on this host, from its worker
    processes' start-up specs (a tensor-parallel group: its ranks' devices, joined by "+")."""
    front = _front_zero(target)
    if front is None:
        return {}
    found: dict[int, list[tuple[int, str]]] = {}
    for child in front.children():
        spec = _worker_spec(child)
        if spec is not None:
            found.setdefault(spec[0], []).append((spec[1], spec[2]))
    return {k: "+".join(d for _, d in sorted(v)) for k, v in found.items()}


def _listeners(target: str) -> list[int]:
    """The pids listening on the target's port, when the target is on this host."""
    host, _, port = target.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "0.0.0.0", "[::1]", "::1") or not port.isdigit():
        return []
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return []
    return sorted({c.pid for c in connections
                   if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port) and c.pid})


def listener_pid(target: str) -> int | None:
    """The process listening on the target's port on this host (any server), else None."""
    found = _listeners(target)
    return found[0] if found else None


def _front_zero(target: str) -> psutil.Process | None:
    """Front 0 of a server listening on this host: a listener on the port that is not a child
    front (a child front's parent is front 0)."""
    for pid in _listeners(target):
        try:
            process = psutil.Process(pid)
            if _front_index(process) is None:
                return process
            parent = process.parent()
        except psutil.Error:
            continue
        if parent is not None:
            return parent
    return None


def _front_index(process: psutil.Process) -> int | None:
    """K for a `python -m cadence.lifecycle.front_child K ...` process, else None."""
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return None
    if _FRONT_CHILD in cmdline:
        i = cmdline.index(_FRONT_CHILD)
        if i + 1 < len(cmdline) and cmdline[i + 1].isdigit():
            return int(cmdline[i + 1])
    return None


def _has_metrics_port(process: psutil.Process) -> bool:
    try:
        return any(arg.startswith("--metrics-port") for arg in process.cmdline())
    except psutil.Error:
        return False


def metrics_url(target: str) -> str | None:
    """The /metrics address of a local cadence server started with --metrics-port: front 0's
    other listening TCP port (with `--fronts N`, the endpoint that shows every front's)."""
    front = _front_zero(target)
    if front is None or not _has_metrics_port(front):
        return None  # another server (its other ports speak other protocols), or no metrics
    grpc_port = int(target.rpartition(":")[2])
    for conn in front.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port != grpc_port:
            return f"http://{conn.laddr.ip}:{conn.laddr.port}/metrics"
    return None


_SCRAPED_GAUGES = ("cadence_deepest_buffer_steps", "cadence_active_streams",
                   "cadence_worker_batch_size", "cadence_paused_sequences")
_SCRAPED_COUNTERS = ("cadence_merged_steps_total", "cadence_buffer_overflows_total",
                     "cadence_sequence_pauses_total", "cadence_chunks_total",
                     "cadence_output_tokens_total")


_LOOP_SAMPLES = "cadence_event_loop_lag_seconds_count"
_LOOP_LAG = (_LOOP_SAMPLES, "cadence_event_loop_lag_seconds_bucket")
_LATE_S = "0.02"
"""The bucket bound above which a wake-up of the front's loop counts as late."""
_LOOP_ON_TIME = f"cadence_event_loop_lag_seconds_bucket{{le={_LATE_S}}}"


_STARTUP_GAUGES = ("cadence_worker_load_seconds", "cadence_worker_warmup_seconds",
                   "cadence_worker_first_step_seconds", "cadence_worker_warm_step_seconds")
"""Each worker's start-up (its last start), kept apart from _SCRAPED_GAUGES: they hold still
during a run, so peaks of them would say nothing."""
_STARTUP_COUNTERS = ("cadence_worker_restarts_total",)
"""Per worker, so not among _SCRAPED_COUNTERS (whose growth is taken under the bare name)."""
_STARTUP = _STARTUP_GAUGES + _STARTUP_COUNTERS


_MAX_OVER_FRONTS = ("cadence_deepest_buffer_steps", *_STARTUP)
"""With `--fronts N`, values whose all-fronts value is the largest front's; the others (and
every other counter) add up: each front counts its own streams and its own share of each
worker's batch (a front's batch gauge holds its last step with any of its sequences, so the
sum can run ahead of the worker's batch while a front has none). The start-up values are the
worker's own, the same on every front that has them (restarts: front 0's alone), so adding
them up would count a worker once per front."""


def scrape(url: str) -> dict[str, float]:
    """The cadence gauges and counters of one /metrics page, keyed by name{labels}.

    Front 0 of `--fronts N` labels every front's samples with `front`: those are kept, and
    each is also combined over the fronts under its name without that label, so the same
    keys as with one front hold the whole server's values.
    """
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=2) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    combined: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name in _SCRAPED_GAUGES or sample.name in _SCRAPED_COUNTERS
                    or sample.name in _STARTUP
                    or (sample.name in _LOOP_LAG and sample.labels.get("le", _LATE_S) == _LATE_S)):
                values[_key(sample.name, sample.labels)] = sample.value
                if "front" in sample.labels:
                    rest = {k: v for k, v in sample.labels.items() if k != "front"}
                    key = _key(sample.name, rest)
                    if key not in combined:
                        combined[key] = sample.value
                    elif sample.name in _MAX_OVER_FRONTS:
                        combined[key] = max(combined[key], sample.value)
                    else:
                        combined[key] += sample.value
    return {**values, **combined}


_STARTUP_FIELDS = (("load_s", "cadence_worker_load_seconds"),
                   ("warmup_s", "cadence_worker_warmup_seconds"),
                   ("first_step_s", "cadence_worker_first_step_seconds"),
                   ("warm_step_s", "cadence_worker_warm_step_seconds"),
                   ("restarts", "cadence_worker_restarts_total"))


def worker_startup(server_metrics: dict | None) -> list[dict]:
    """Each worker's start-up from a run's scrapes (`server_metrics` of a bench result):
    [{"worker": 0, "load_s", "warmup_s", "first_step_s", "warm_step_s", "restarts",
    "restarts_during_run"}, ...], from the last scrape (a worker restarted during the run shows
    its new start). A field the server did not export is None; [] when no worker has any
    (no scrape, an app server, or a result saved before the server exported them).
    """
    samples = (server_metrics or {}).get("samples") or []
    if not samples:
        return []
    first, last = samples[0][1], samples[-1][1]
    workers: dict[int, dict] = {}
    for key, value in last.items():
        name, _, labels = key.partition("{")
        # Only the keys labelled by worker alone: with `--fronts N` those hold the value
        # over all fronts, and the per-front copies (front=K,worker=W) repeat it.
        if name in _STARTUP and labels.startswith("worker=") and "," not in labels:
            worker = int(labels[len("worker="):].rstrip("}"))
            workers.setdefault(worker, {})[name] = value
    rows = []
    for worker in sorted(workers):
        found = workers[worker]
        row: dict = {"worker": worker}
        for field, name in _STARTUP_FIELDS:
            row[field] = found.get(name)
        restarts_key = _key("cadence_worker_restarts_total", {"worker": str(worker)})
        row["restarts_during_run"] = (None if row["restarts"] is None
                                      else row["restarts"] - first.get(restarts_key, 0.0))
        rows.append(row)
    return rows


def _key(name: str, labels: dict[str, str]) -> str:
    text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{text}}}" if text else name


class SystemSampler:
    """Samples every watched process's CPU % (100 = one core) and every card's utilisation."""

    def __init__(self, interval_s: float = 0.1, metrics_url: str | None = None,
                 scrape_every: int = 5) -> None:
        self.interval_s = interval_s
        self._metrics_url = metrics_url
        self._scrape_every = scrape_every
        self._scrapes: list[tuple[float, dict[str, float]]] = []
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
        ticks = 0
        self._scrape(0.0)
        while not self._stop.wait(self.interval_s):
            t = time.monotonic() - self._t0
            ticks += 1
            if ticks % self._scrape_every == 0:
                self._scrape(t)
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
        except (OSError, http.client.HTTPException, ValueError):
            return  # a missed or unreadable scrape leaves a gap, nothing more
        if values:  # none: not a cadence server's page (another server of the protocol)
            self._scrapes.append((t, values))

    def _server_metrics(self) -> dict | None:
        if not self._scrapes:
            return None
        first, last = self._scrapes[0][1], self._scrapes[-1][1]
        peaks: dict[str, float] = {}
        for _, values in self._scrapes:
            for key, value in values.items():
                if key.split("{")[0] in _SCRAPED_GAUGES:
                    peaks[key] = max(peaks.get(key, value), value)
        return {
            "url": self._metrics_url,
            "scrapes": len(self._scrapes),
            "peaks": peaks,
            "during_run": {k: last.get(k, 0.0) - first.get(k, 0.0) for k in _SCRAPED_COUNTERS},
            "front_loop": self._front_loop(first, last),
            "samples": [[t, v] for t, v in self._scrapes],
        }

    @staticmethod
    def _front_loop(first: dict, last: dict) -> dict | None:
        """The front's event-loop lag samples of the run, and how many came over 20 ms late."""
        if _LOOP_SAMPLES not in last:
            return None  # a server that does not export it
        samples = last[_LOOP_SAMPLES] - first.get(_LOOP_SAMPLES, 0.0)
        on_time = last.get(_LOOP_ON_TIME, 0.0) - first.get(_LOOP_ON_TIME, 0.0)
        return {"samples": samples, "late_over_20ms": samples - on_time}

    def stop(self) -> dict:
        """Stop sampling; the samples and their means and peaks, plus the S10 flag."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._scrape(time.monotonic() - self._t0)
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
                "server_metrics": self._server_metrics(),
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
