"""The engine threads' wait for a CPU (`cadence.worker.cpu_wait`), read from Linux's schedstat:
which threads it watches, that a thread kept off its CPU by another process shows a wait,
and that a step carries its figure (absent, not 0, where there is none)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from cadence.worker.batch_scheduler import BatchScheduler
from cadence.worker.cpu_wait import ABSENT, CpuWait, thread_ids
from tests.unit.worker.test_batch_scheduler import engine, req, run_to_end

linux = pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"), reason="Linux's schedstat"
)

MS = 1_000_000


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@linux
def test_it_watches_the_calling_thread_and_the_threads_born_since_not_those_before() -> None:
    stop = threading.Event()
    before_thread = threading.Thread(target=stop.wait)
    before_thread.start()
    before = thread_ids()
    assert before is not None and before_thread.native_id in before
    engine_thread = threading.Thread(target=stop.wait)
    engine_thread.start()
    try:
        waits = CpuWait.of_engine(before)
        assert waits is not None and waits.threads == 2  # this thread and the one born since
        assert waits.since_last() >= 0
        stop.set()
        engine_thread.join()
        before_thread.join()
        time.sleep(0.01)  # the kernel reaps the exited thread
        # The exited thread's read fails: it is dropped, the step thread still measured.
        assert waits.since_last() >= 0 and waits.threads == 1
        waits.close()
    finally:
        stop.set()


def test_without_proc_there_is_no_figure() -> None:
    assert CpuWait.of_engine(None) is None
    assert CpuWait([]).since_last() == ABSENT  # no thread left to read: absent, not 0


@linux
def test_a_thread_kept_off_its_cpu_by_another_process_shows_the_wait() -> None:
    """The step thread and a spinning process pinned to one CPU take turns on it: the step
    thread waits in the run queue while the other runs, which its next reading holds. Alone
    on the CPU it waits next to nothing: the reading is the wait, not the time it ran."""
    cpu = min(os.sched_getaffinity(0))
    was = os.sched_getaffinity(0)
    waits = CpuWait([threading.get_native_id()])
    os.sched_setaffinity(0, {cpu})  # this thread only (Linux applies it per thread)
    spinner = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        time.sleep(0.2)  # the spinner runs
        waits.since_last()
        _spin(0.3)
        contended = waits.since_last()
    finally:
        spinner.kill()
        spinner.wait()
    _spin(0.05)
    waits.since_last()
    _spin(0.3)
    alone = waits.since_last()
    os.sched_setaffinity(0, was)
    waits.close()
    # Sharing one CPU for 300 ms, the thread waited for it a good part of that time.
    assert contended >= 50 * MS, contended
    assert alone < contended, (alone, contended)


@linux
def test_each_step_carries_its_threads_wait_and_an_unmeasured_one_says_so() -> None:
    measured = BatchScheduler(engine(), 0, 8, cpu_wait=CpuWait([threading.get_native_id()]))
    assert measured.add(req(1, max_tokens=3)) is None
    outs = run_to_end(measured)
    assert len(outs) == 3 and all(o.cpu_wait_ns >= 0 for o in outs)
    plain = BatchScheduler(engine(), 0, 8)
    assert plain.add(req(1, max_tokens=3)) is None
    assert all(o.cpu_wait_ns == ABSENT for o in run_to_end(plain))
