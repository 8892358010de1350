"""What a Python server's threads are doing during a run, by `py-spy dump` (an optional
tool: `pip install py-spy`): every few hundred ms, each thread's innermost frame and the
first frame of the server's own code, counted per thread group ("4 of 4 pool threads inside
Queue.get, called from the handler"). Dumps are taken with --nonblocking, so the server is
never paused for them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections import Counter
from pathlib import Path

from cadence.lab.measure.threads import group_name
from cadence.lab.results import StackGroup, StackSpot

_LIBRARY_ROOTS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)
_DUMP_TIMEOUT_S = 5.0
MAX_DUMPS = 8
"""Dumps per process over the run: enough to see where threads sit, few enough to cost the
host little (each dump is a short process of its own)."""


def py_spy() -> str | None:
    """The py-spy command: beside this Python (a virtualenv's), else on PATH; None if absent."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _own_code(frames: list[dict]) -> str | None:
    """The innermost frame outside the standard library and installed packages: where the
    server's own code was (its handler), as NAME (FILE)."""
    for frame in frames:
        filename = frame.get("filename", "")
        library = filename.startswith(_LIBRARY_ROOTS) or "site-packages" in filename
        if filename and not library:
            return f"{frame['name']} ({frame.get('short_filename', filename)})"
    return None


class StackSampler:
    """`start()` when the run starts, `stop()` after: the thread groups' stacks, or None."""

    def __init__(self, pids: list[int], interval_s: float = 0.3) -> None:
        self._pids = pids
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._spots: dict[str, Counter] = {}
        self._samples: Counter = Counter()
        self._threads: dict[str, set] = {}
        self._thread = threading.Thread(target=self._run, name="cadence-stacks", daemon=True)
        self._command = py_spy()

    @property
    def installed(self) -> bool:
        """Whether py-spy is installed on this host (the bench's, which the result records:
        the report says what py-spy would add only where it was missing there)."""
        return self._command is not None

    def start(self) -> None:
        if self._pids and self._command:
            self._thread.start()

    def _run(self) -> None:
        for _ in range(MAX_DUMPS):
            for pid in self._pids:
                self._dump(pid)
            if self._stop.wait(self._interval_s):
                return

    def _dump(self, pid: int) -> None:
        if self._command is None:  # start() runs no thread without py-spy
            return
        try:
            done = subprocess.run(
                [self._command, "dump", "--pid", str(pid), "--json", "--nonblocking"],
                capture_output=True,
                text=True,
                timeout=_DUMP_TIMEOUT_S,
                check=False,
            )
            threads = json.loads(done.stdout) if done.returncode == 0 else []
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return  # not a Python process, gone, or no permission: nothing to count
        for thread in threads:
            frames = thread.get("frames") or []
            group = group_name(thread.get("thread_name") or "thread")
            where = frames[0]["name"] if frames else "(no Python frame)"
            spot = (where if thread.get("active") else f"{where} (idle)", _own_code(frames))
            self._spots.setdefault(group, Counter())[spot] += 1
            self._samples[group] += 1
            self._threads.setdefault(group, set()).add((pid, thread.get("thread_id")))

    def stop(self) -> list[StackGroup] | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if not self._samples:
            return None
        return [
            StackGroup(
                name=group,
                threads=len(self._threads[group]),
                samples=self._samples[group],
                spots=[
                    StackSpot(where=where, code=code, count=count)
                    for (where, code), count in self._spots[group].most_common(3)
                ],
            )
            for group, _ in self._samples.most_common()
        ]
