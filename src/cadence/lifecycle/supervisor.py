"""Watches worker processes: a worker that exits or stops stepping is failed, then restarted.

`WorkerSupervisor` is front 0's (it launched the workers); `WorkerWatcher` is a child front's
with `--fronts N` (it follows the workers front 0 launched).

Its streams end at once with UNAVAILABLE and a message naming the worker, the router stops
sending it requests until its replacement reports ready, and the other workers' streams are
untouched. Restarts back off (1 s, 2 s, 4 s, ... up to 30 s) so a worker that cannot start,
or dies soon after each start, does not spin; the back-off resets once a replacement has run
for `_STABLE_S`.

The hang check (`--worker-timeout`) times how long a worker with something to step has gone
without output: its clock starts at its last output or when it last had nothing to step (no
request, or every request paused by a client that does not read), whichever is later, so
an idle spell never counts against the first step after it. Front 0 keeps that clock for its
own requests, and each worker keeps it for all of its sequences, whichever front they came
from, and reports it in every heartbeat (`Heartbeat.stalled_ns`, cadence.worker.step_health):
either past the timeout is a hang.

A worker whose engine steps fail one after another (`--worker-max-failed-steps` in a row, none
succeeding: a sticky device error) says so to every front (`StepsFailing`); each front stops
routing to it at once (`eject`), and front 0 kills it, counts the ejection
(`cadence_worker_ejections_total`) and restarts it with the same back-off, as Envoy's outlier
detection ejects a host after consecutive errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from cadence.config import WorkerSpec
from cadence.lifecycle.launcher import Launcher, WorkerHandle
from cadence.router import WorkerRouter
from cadence.transport.front_channel import WorkerLink
from cadence.worker import process_gone

log = logging.getLogger("cadence.supervisor")

_CHECK_INTERVAL_S = 0.2
_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
_STABLE_S = 30.0
"""A worker that ran this long before it failed restarts after the first back-off again."""


class WorkerSupervisor:
    """Owns the worker handles: launches, watches, kills hung ones and restarts them."""

    def __init__(
        self,
        launcher: Launcher,
        specs: list[WorkerSpec],
        router: WorkerRouter,
        links: Sequence[WorkerLink],
        *,
        on_down: Callable[[int, str], None],
        on_health: Callable[[], None],
        hang_timeout_s: float | None,
        restart: bool,
        heartbeat_timeout_s: float | None = None,
    ) -> None:
        self._launcher = launcher
        self._specs = specs
        self._router = router
        self._links = links
        self._on_down = on_down
        self._on_health = on_health
        self._hang_timeout_ns = int(hang_timeout_s * 1e9) if hang_timeout_s else None
        self._restart = restart
        self.workers: list[WorkerHandle] = []
        self.ready = [False] * len(specs)
        self.restarts = [0] * len(specs)
        self._heartbeat_timeout_ns = int(heartbeat_timeout_s * 1e9) if heartbeat_timeout_s else None
        self.last_output_ns = [time.monotonic_ns()] * len(specs)
        """Updated by the output reader on every step from a worker."""
        self.last_heard_ns = [0] * len(specs)
        """Updated by the output reader on every heartbeat (0: none since the last start)."""
        self.stalled_ns = [0] * len(specs)
        """Updated by the output reader on every heartbeat: how long the worker has had
        sequences (of any front) to step without finishing a step."""
        self.ejections = [0] * len(specs)
        """Times each worker was taken out for failing its steps (`eject`)."""
        self._idle_ns = [0] * len(specs)
        """When each worker was last seen with nothing to step."""
        self._ready_at = [0.0] * len(specs)
        self._restart_at: dict[int, float] = {}
        self._retired: set[int] = set()
        """Workers down for good (`--no-restart`): no longer watched."""
        self._backoff = [_FIRST_BACKOFF_S] * len(specs)
        self.restart_delay_s = [0.0] * len(specs)
        """The back-off before each worker's pending restart (0: none pending)."""
        self.stopping = False

    def launch(self) -> None:
        """Start every worker."""
        self.workers = [self._launcher.launch(spec) for spec in self._specs]

    def exited(self) -> tuple[int, int] | None:
        """(index, exit status) of a worker that has stopped, or None (start-up's check)."""
        for worker in self.workers:
            code = worker.exit_code()
            if code is not None:
                return worker.index, code
        return None

    def mark_ready(self, index: int, pid: int) -> None:
        """A worker (first start or replacement) reported ready: route to it again."""
        self.ready[index] = True
        self.last_output_ns[index] = time.monotonic_ns()
        self.stalled_ns[index] = 0
        self._ready_at[index] = time.monotonic()
        self._router.alive[index] = True
        self._on_health()

    async def run(self) -> None:
        """Check every worker a few times a second until stopped."""
        while not self.stopping:
            await asyncio.sleep(_CHECK_INTERVAL_S)
            if self.stopping:
                return
            now = time.monotonic_ns()
            for i, worker in enumerate(self.workers):
                if i in self._retired:
                    continue
                if i in self._restart_at:
                    if time.monotonic() >= self._restart_at[i]:
                        del self._restart_at[i]
                        self.restart_delay_s[i] = 0.0
                        log.warning("restarting worker %d (restart %d)", i, self.restarts[i] + 1)
                        self.restarts[i] += 1
                        self.last_heard_ns[i] = self.stalled_ns[i] = 0
                        self.workers[i] = self._launcher.launch(self._specs[i])
                    continue
                if self._router.requests[i] <= self._links[i].paused:
                    self._idle_ns[i] = now  # nothing to step: the hang clock does not run
                code = worker.exit_code()
                if code is not None:
                    self._down(i, f"worker {i} stopped (exit status {code}); retry the request")
                elif (
                    self._hang_timeout_ns is not None
                    and self.ready[i]
                    and (
                        now
                        - max(
                            self.last_output_ns[i], self._idle_ns[i], self._router.busy_since_ns[i]
                        )
                        > self._hang_timeout_ns
                        or self.stalled_ns[i] > self._hang_timeout_ns
                    )  # any front's work
                ):
                    worker.kill()
                    self._down(
                        i,
                        f"worker {i} made no step for "
                        f"{self._hang_timeout_ns / 1e9:.0f} s and was stopped; retry",
                    )
                elif (
                    # Silent (gone, stopped, or cut off by the network) before its process
                    # is seen to exit; a worker that never beat (inside the front) is exempt.
                    self._heartbeat_timeout_ns is not None
                    and self.ready[i]
                    and self.last_heard_ns[i]
                    and now - self.last_heard_ns[i] > self._heartbeat_timeout_ns
                ):
                    worker.kill()
                    self._down(
                        i,
                        f"worker {i} sent no heartbeat for "
                        f"{self._heartbeat_timeout_ns / 1e9:g} s and was stopped; retry",
                    )

    def eject(self, index: int, message: str) -> None:
        """The worker reported its steps failing in a row: route around it, kill it, and
        restart it (with back-off), as a hung one."""
        if not self.ready[index]:
            return  # already down (a report that crossed its kill)
        self.ejections[index] += 1
        self.workers[index].kill()
        self._down(index, message)

    def _down(self, index: int, message: str) -> None:
        log.error("%s", message)
        self.ready[index] = False
        self._router.mark_dead(index)
        self._on_down(index, message)
        self._on_health()
        if not self._restart:
            self._retired.add(index)  # --no-restart: down for good, said once
        elif not self.stopping:
            now = time.monotonic()
            if self._ready_at[index] and now - self._ready_at[index] >= _STABLE_S:
                self._backoff[index] = _FIRST_BACKOFF_S
            self._ready_at[index] = 0.0  # a replacement that dies before ready ran for no time
            delay = self.restart_delay_s[index] = self._backoff[index]
            if delay > _FIRST_BACKOFF_S:
                log.error(
                    "worker %d keeps failing (%d restarts so far); restarting it in %.0f s",
                    index,
                    self.restarts[index],
                    delay,
                )
            self._restart_at[index] = now + delay
            self._backoff[index] = min(delay * 2, _MAX_BACKOFF_S)

    async def stop(self, links) -> None:
        """Ask every worker to shut down, then make sure it has: SIGTERM, then SIGKILL."""
        self.stopping = True
        for link in links:
            link.shutdown()
        for i, worker in enumerate(self.workers):
            if not self.ready[i]:
                # Still loading (a stop during start-up, or a restart): it reads no Shutdown
                # before it is ready, and has no stream to finish.
                worker.terminate()
        for worker in self.workers:
            if await asyncio.to_thread(worker.wait, 5.0) is None:
                worker.terminate()
                if await asyncio.to_thread(worker.wait, 2.0) is None:
                    worker.kill()
                    await asyncio.to_thread(worker.wait, 2.0)


class WorkerWatcher:
    """A child front's view of the workers: ready once each said so to this front, down when
    its process is gone (front 0 restarts it; the replacement reports ready again)."""

    def __init__(
        self,
        router: WorkerRouter,
        workers: int,
        *,
        on_down: Callable[[int, str], None],
        on_health: Callable[[], None],
    ) -> None:
        self._router = router
        self._on_down = on_down
        self._on_health = on_health
        self.ready = [False] * workers
        self.pids = [0] * workers
        self.last_output_ns = [time.monotonic_ns()] * workers
        self.last_heard_ns = [0] * workers
        self.stalled_ns = [0] * workers
        """Kept by the output reader; front 0 acts on them."""
        self.stopping = False

    def exited(self) -> None:
        """Front 0 owns the workers' processes and fails the start if one exits."""

    def mark_ready(self, index: int, pid: int) -> None:
        self.ready[index] = True
        self.pids[index] = pid
        self._router.alive[index] = True
        self._on_health()

    def eject(self, index: int, message: str) -> None:
        """The worker reported its steps failing in a row: route around it now (front 0
        kills and restarts it; its replacement reports ready again)."""
        if self.ready[index]:
            self._down(index, message)

    async def run(self) -> None:
        while not self.stopping:
            await asyncio.sleep(_CHECK_INTERVAL_S)
            for i, pid in enumerate(self.pids):
                if self.ready[i] and pid and process_gone(pid):
                    self._down(i, f"worker {i} stopped; retry the request")

    def _down(self, index: int, message: str) -> None:
        self.ready[index] = False
        self._router.mark_dead(index)
        log.error("%s", message)
        self._on_down(index, message)
        self._on_health()
