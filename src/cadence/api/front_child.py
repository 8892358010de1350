"""`--fronts N`: fronts 1..N-1, each a child process of front 0 (`cadence serve` itself).

Started as `python -m cadence.api.front_child K BASE_DIR CONFIG_JSON`. A child front serves
the same port (SO_REUSEPORT) with the same code as front 0 (`CadenceServer` with `front=K`),
binds its own sockets in front 0's private folder, and is connected to by every worker. It
launches no workers: `WorkerWatcher` follows the ones front 0 launched (they report ready to
every front) and fails this front's streams on a worker that stopped. Like a worker, it has
its own session (Ctrl-C reaches front 0 only, which stops it in order) and dies with front 0
(PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import msgspec

from cadence import event_loop
from cadence.router import WorkerRouter

log = logging.getLogger("cadence.front")

_CHECK_INTERVAL_S = 0.2


def _gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by front 0 counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class WorkerWatcher:
    """A child front's view of the workers: ready once each said so to this front, down when
    its process is gone (front 0 restarts it; the replacement reports ready again)."""

    def __init__(self, router: WorkerRouter, workers: int, *,
                 on_down: Callable[[int, str], None], on_health: Callable[[], None]) -> None:
        self._router = router
        self._on_down = on_down
        self._on_health = on_health
        self.ready = [False] * workers
        self.pids = [0] * workers
        self.workers: list = []  # front 0 owns the handles
        self.last_output_ns = [time.monotonic_ns()] * workers
        self.stopping = False

    def mark_ready(self, index: int, pid: int) -> None:
        self.ready[index] = True
        self.pids[index] = pid
        self._router.alive[index] = True
        self._on_health()

    async def run(self) -> None:
        while not self.stopping:
            await asyncio.sleep(_CHECK_INTERVAL_S)
            for i, pid in enumerate(self.pids):
                if self.ready[i] and pid and _gone(pid):
                    self.ready[i] = False
                    self._router.mark_dead(i)
                    message = f"worker {i} stopped; retry the request"
                    log.error("%s", message)
                    self._on_down(i, message)
                    self._on_health()

    async def stop(self, links) -> None:
        """Front 0 stops the workers; a child front only stops watching."""
        self.stopping = True


async def _serve(front: int, base: str, config) -> None:
    from cadence.api.server import CadenceServer

    server = CadenceServer(config, front=front, base_dir=base)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    from cadence.config import ServerConfig
    from cadence.worker.process import _die_with_parent

    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    if os.getppid() == 1:  # front 0 died before prctl took effect
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    front, base = int(argv[0]), argv[1]
    config = msgspec.json.decode(argv[2].encode(), type=ServerConfig)
    logging.basicConfig(level=int(argv[3]) if len(argv) > 3 else logging.WARNING,
                        format=f"%(asctime)s front-{front} %(name)s %(message)s")
    event_loop.run(_serve(front, base, config))


if __name__ == "__main__":
    main()
