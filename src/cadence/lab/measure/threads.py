"""Every thread of a server and its child processes, read from /proc at the start and the end
of a run: CPU per thread, time spent waiting for a CPU (schedstat), and context switches,
grouped by thread name. Any server on this host, whatever its language: gRPC's pollers, an
asyncio loop, ThreadPoolExecutor workers, NCCL/gloo, OpenMP, Go's runtime threads, a JVM's
grpc-default-executor all show under their own names.

Two readings, not a sampling thread: the counters are cumulative, so their differences over
the run are exact, and reading them costs the server nothing while it serves.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import psutil

from cadence.lab.results import ServerProcessThreads, ServerThreads, ThreadGroup

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_NUMBERED = re.compile(r"\d+")


@dataclass(frozen=True)
class _Thread:
    process: int
    name: str
    cpu_s: float
    run_ns: int
    wait_ns: int
    voluntary: int
    involuntary: int


def _threads(pids: list[int]) -> dict[tuple[int, int], _Thread]:
    """(pid, tid) -> the thread's counters now, for `pids` and all their descendants."""
    found: dict[tuple[int, int], _Thread] = {}
    for pid in _with_children(pids):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            thread = _read(pid, tid)
            if thread is not None:
                found[(pid, int(tid))] = thread
    return found


def _with_children(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        out.append(pid)
        try:
            out.extend(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass
    return list(dict.fromkeys(out))


def _read(pid: int, tid: str) -> _Thread | None:
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/stat") as f:
            stat = f.read()
        with open(f"{base}/schedstat") as f:
            run_ns, wait_ns, _ = (int(x) for x in f.read().split())
        with open(f"{base}/status") as f:
            status = dict(line.split(":\t", 1) for line in f if ":\t" in line)
    except (OSError, ValueError):
        return None  # the thread ended meanwhile, or a kernel without schedstat
    # The name is between the first "(" and the last ")": it may hold spaces and parentheses.
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    # schedstat's time on a CPU, in ns; stat's user + system time counts whole clock ticks.
    cpu_s = run_ns / 1e9 if run_ns else (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    return _Thread(
        pid,
        name,
        cpu_s,
        run_ns,
        wait_ns,
        int(status.get("voluntary_ctxt_switches", "0")),
        int(status.get("nonvoluntary_ctxt_switches", "0")),
    )


def group_name(name: str) -> str:
    """A thread's group: its name with numbers as `N` (ThreadPoolExecutor-0_3 and _4 are one
    pool; the kernel keeps 15 characters of a name)."""
    return _NUMBERED.sub("N", name)


class ThreadReader:
    """`start()` before the run, `stop()` after: the server's threads over the run."""

    def __init__(self, pids: list[int]) -> None:
        self._pids = pids
        self._before: dict[tuple[int, int], _Thread] = {}
        self._t0 = 0.0

    def start(self) -> None:
        self._before = _threads(self._pids)
        self._t0 = time.monotonic()

    def stop(self) -> ServerThreads | None:
        if not self._pids:
            return None
        wall_s = time.monotonic() - self._t0
        after = _threads(self._pids)
        if not after or wall_s <= 0:
            return None
        groups: dict[str, dict] = {}
        for key, now in after.items():
            then = self._before.get(key)
            cpu_s = now.cpu_s - (then.cpu_s if then else 0.0)
            run_ns = now.run_ns - (then.run_ns if then else 0)
            wait_ns = now.wait_ns - (then.wait_ns if then else 0)
            voluntary = now.voluntary - (then.voluntary if then else 0)
            involuntary = now.involuntary - (then.involuntary if then else 0)
            g = groups.setdefault(
                group_name(now.name),
                {
                    "threads": 0,
                    "processes": set(),
                    "cpu_s": 0.0,
                    "busiest_s": 0.0,
                    "run_ns": 0,
                    "wait_ns": 0,
                    "voluntary": 0,
                    "involuntary": 0,
                },
            )
            g["threads"] += 1
            g["processes"].add(now.process)
            g["cpu_s"] += cpu_s
            g["busiest_s"] = max(g["busiest_s"], cpu_s)
            g["run_ns"] += run_ns
            g["wait_ns"] += wait_ns
            g["voluntary"] += voluntary
            g["involuntary"] += involuntary
        rows = [
            ThreadGroup(
                name=name,
                threads=g["threads"],
                processes=len(g["processes"]),
                cpu_pct=100 * g["cpu_s"] / wall_s,
                busiest_thread_cpu_pct=100 * g["busiest_s"] / wall_s,
                wait_for_cpu_pct=100 * g["wait_ns"] / 1e9 / wall_s,
                wait_share=g["wait_ns"] / (g["run_ns"] + g["wait_ns"])
                if g["run_ns"] + g["wait_ns"]
                else 0.0,
                voluntary_switches_per_s=g["voluntary"] / wall_s,
                involuntary_switches_per_s=g["involuntary"] / wall_s,
            )
            for name, g in groups.items()
        ]
        rows.sort(key=lambda r: r.cpu_pct, reverse=True)
        return ServerThreads(
            wall_s=wall_s,
            pids=list(self._pids),
            cpus=os.cpu_count() or 1,
            threads=sum(r.threads for r in rows),
            groups=rows,
            processes=self._processes(after, wall_s),
        )

    def _processes(
        self, after: dict[tuple[int, int], _Thread], wall_s: float
    ) -> list[ServerProcessThreads]:
        """Per process: its CPU over the run and its busiest thread (a process at one core
        spread over many threads is one that a lock such as Python's GIL holds to one)."""
        per: dict[int, list[tuple[str, float, float]]] = {}
        for key, now in after.items():
            then = self._before.get(key)
            per.setdefault(now.process, []).append(
                (
                    now.name,
                    now.cpu_s - (then.cpu_s if then else 0.0),
                    (now.wait_ns - (then.wait_ns if then else 0)) / 1e9,
                )
            )
        rows = []
        for pid, threads in per.items():
            name, busiest, waited = max(threads, key=lambda t: t[1])
            try:
                command = psutil.Process(pid).cmdline()
            except psutil.Error:
                command = []
            rows.append(
                ServerProcessThreads(
                    pid=pid,
                    command=" ".join(command)[:200],
                    threads=len(threads),
                    python=any("python" in os.path.basename(part) for part in command[:1]),
                    cpu_pct=100 * sum(cpu for _, cpu, _ in threads) / wall_s,
                    busiest_thread=name,
                    busiest_thread_cpu_pct=100 * busiest / wall_s,
                    busiest_thread_wait_pct=100 * waited / wall_s,
                )
            )
        rows.sort(key=lambda r: r.cpu_pct, reverse=True)
        return rows
