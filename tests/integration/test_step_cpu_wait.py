"""A real server's timed chunks carry each step's wait for a CPU (cadence.v1's
`Timing.step_cpu_wait_ns`), the lab's load driver keeps it per chunk, and a worker whose step
thread shares its CPU with a spinning process shows the wait."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cadence.client import Client
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from tests.integration.conftest import start_server

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"), reason="Linux's schedstat"
)


def test_timed_chunks_carry_their_steps_wait_and_the_lab_keeps_it() -> None:
    with start_server("--devices", "cpu:1", "--step-ms", "2") as server:
        with Client(server.target) as client:
            chunks = list(client.generate("wait", max_tokens=20, include_timing=True))
            untimed = list(client.generate("wait", max_tokens=5))
        workload = Workload(requests=4, concurrency=2, shape=RequestShape(max_tokens=(10, 10)))
        result = run_bench(server.target, workload, processes=1)
    with_tokens = [c for c in chunks if c.token_ids]
    assert with_tokens and all(c.timing.HasField("step_cpu_wait_ns") for c in with_tokens)
    assert all(c.timing.step_cpu_wait_ns >= 0 for c in with_tokens)
    assert not any(c.HasField("timing") for c in untimed)
    assert result.requests_ok == 4
    for record in result.records:
        assert len(record.t_step_cpu_wait_ns) == len(record.arrival_ns)
        assert all(w >= 0 for w, n in zip(record.t_step_cpu_wait_ns, record.tokens) if n)


SPINNER = """
import os
os.sched_setaffinity(0, {{{cpu}}})
print("spinning", flush=True)
while True:
    pass
"""
"""A process that never sleeps, on CPU `cpu` alone; it says when it is there."""


def _waited_ns(pid: int) -> int:
    """How long the process's main thread has waited for a CPU (its schedstat's run_delay)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[1])


def test_a_step_thread_sharing_its_cpu_with_a_spinner_shows_the_wait() -> None:
    """The worker's step thread and a process that never sleeps pinned to one CPU take turns
    on it: the steps' threads waited for it, and the chunks say so, no more than the thread's
    own reading says it waited meanwhile. The steps are spun, not slept (under the synthetic
    engine's half millisecond of spin), as a CPU engine's compute is: a thread that sleeps
    most of its step gets the CPU back at each wake-up. A thousand of them: the scheduler
    may favour a thread that slept over the spinner for a while, not for long."""
    with start_server("--devices", "cpu:1", "--step-ms", "0.4") as server:
        [worker] = server.workers
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(worker.pid, {cpu})  # its main thread: the step loop's
        spinner = subprocess.Popen(
            [sys.executable, "-c", SPINNER.format(cpu=cpu)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert spinner.stdout is not None and spinner.stdout.readline() == "spinning\n"
            before = _waited_ns(worker.pid)
            with Client(server.target) as client:
                chunks = list(client.generate("wait", max_tokens=1000, include_timing=True))
            waited = _waited_ns(worker.pid) - before
        finally:
            spinner.kill()
            spinner.wait()
    waits = [c.timing.step_cpu_wait_ns for c in chunks if c.token_ids]
    # The waits add up to scheduler slices; a merged chunk carries its first step's only.
    assert 10_000_000 <= sum(waits) <= waited + 5_000_000, (sum(waits), waited)
