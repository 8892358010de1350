"""`--fronts N`, front 0's side: fronts 1..N-1 as child processes, launched, waited for,
watched, restarted and stopped.

A child that dies ends only its own streams (its clients see the connection drop). Front 0
frees its admission slots, tells every worker to drop its sequences (`on_gone`), and starts it
again after a back-off (1 s, doubling to 30 s, reset once a restart is ready), as the
supervisor does for workers; the workers are told first (`on_back`), so they send to it again,
beginning with their `WorkerReady`. Restarts are counted (`cadence_front_restarts_total`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import msgspec

from cadence.config import ServerConfig
from cadence.lifecycle import StartupError
from cadence.worker import child_environment

log = logging.getLogger("cadence.server")

_CHECK_INTERVAL_S = 0.2
_POLL_S = 0.05
_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0


class FrontChildren:
    """Fronts 1..N-1 of a server on `port`, sharing front 0's private folder `base`."""

    def __init__(
        self,
        config: ServerConfig,
        base: str,
        port: int,
        *,
        on_gone: Callable[[int], None],
        on_back: Callable[[int], None],
    ) -> None:
        self._config = msgspec.structs.replace(config, port=port)
        self._base = base
        self._on_gone = on_gone
        self._on_back = on_back
        self._children: dict[int, subprocess.Popen] = {}
        self._restart_at: dict[int, float] = {}
        self._backoff = [_FIRST_BACKOFF_S] * config.fronts
        self._waiting_ready: set[int] = set()
        """Restarted fronts whose ready file has not appeared yet (their back-off resets then)."""
        self.restarts = [0] * config.fronts
        """Restarts per front (index 0, front 0 itself, stays 0)."""

    def _ready_file(self, k: int) -> str:
        return f"{self._base}/f{k}-ready"

    def _launch(self, k: int) -> None:
        """Front k as `python -m cadence.lifecycle.front_child`: its own session (Ctrl-C
        reaches front 0 only, which stops it in order) and PDEATHSIG, like a worker."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._ready_file(k))  # a predecessor's
        self._children[k] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cadence.lifecycle.front_child",
                str(k),
                self._base,
                msgspec.json.encode(self._config).decode(),
                str(logging.getLogger().getEffectiveLevel()),
                str(self.restarts[k]),
            ],
            start_new_session=True,
            env=child_environment(),
        )

    def launch(self) -> None:
        for k in range(1, self._config.fronts):
            self._launch(k)

    async def wait_ready(self) -> None:
        """Until every front has written its ready file (it serves by then)."""
        timeout = self._config.startup_timeout_s
        deadline = time.monotonic() + timeout
        for k, child in self._children.items():
            while not os.path.exists(self._ready_file(k)):
                if child.poll() is not None:
                    raise StartupError(
                        f"front {k} exited during start-up (status "
                        f"{child.returncode}); see its output above"
                    )
                if time.monotonic() > deadline:
                    raise StartupError(f"front {k} was not ready within {timeout:.0f} s")
                await asyncio.sleep(_POLL_S)

    async def watch(self) -> None:
        """Forever: notice a front that died, restart it after its back-off."""
        while True:
            await asyncio.sleep(_CHECK_INTERVAL_S)
            now = time.monotonic()
            for k, at in list(self._restart_at.items()):
                if now >= at:
                    del self._restart_at[k]
                    self.restarts[k] += 1
                    log.warning("restarting front %d (restart %d)", k, self.restarts[k])
                    self._on_back(k)
                    self._launch(k)
                    self._waiting_ready.add(k)
            for k in list(self._waiting_ready):
                if os.path.exists(self._ready_file(k)):
                    self._waiting_ready.discard(k)
                    self._backoff[k] = _FIRST_BACKOFF_S
                    log.info("front %d serves again", k)
            for k, child in list(self._children.items()):
                if child.poll() is not None:
                    del self._children[k]
                    self._waiting_ready.discard(k)
                    log.error(
                        "front %d stopped (exit status %s); the other fronts keep "
                        "serving; restarting it in %.0f s",
                        k,
                        child.returncode,
                        self._backoff[k],
                    )
                    self._on_gone(k)
                    self._restart_at[k] = now + self._backoff[k]
                    self._backoff[k] = min(self._backoff[k] * 2, _MAX_BACKOFF_S)

    def terminate(self) -> None:
        """The server's drain begins: SIGTERM every front, which drains like front 0."""
        self._restart_at.clear()
        for child in self._children.values():
            if child.poll() is None:
                child.terminate()

    async def stop(self) -> None:
        """Until every front has exited (SIGKILL after the drain's time and a margin)."""
        self.terminate()
        children = list(self._children.values())
        self._children.clear()
        for child in children:
            try:
                await asyncio.to_thread(child.wait, self._config.drain_timeout_s + 5.0)
            except subprocess.TimeoutExpired:
                child.kill()
                await asyncio.to_thread(child.wait)

    def metrics_texts(self) -> list[tuple[int, str]]:
        """The /metrics text of every other front (front 0 serves them with its own). Runs on
        the metrics server's thread."""
        texts = []
        for k in sorted(self._children):
            try:
                with open(self._ready_file(k)) as f:
                    port = int(f.read().strip() or 0)
                if port:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                        texts.append((k, r.read().decode()))
            except (OSError, ValueError):
                continue
        return texts
