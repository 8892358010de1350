"""App workers inside the front process (`--app-in-front`), behind the launcher seam.

The same `serve_app` that runs in a worker process runs here as a task on the front's event
loop, connected to the front's own ZeroMQ sockets exactly like a worker process, so the
front, the router, the supervisor and the output path do not know the difference. What a
user gains is shared in-process state (one copy of a model or a cache that the front's
other code can also reach); what it costs is that the function, its executor threads and
the front's networking share one GIL and one process (docs/apps.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

from cadence.config import WorkerSpec
from cadence.engines.app import App, load_app
from cadence.worker.app_runner import serve_app

log = logging.getLogger("cadence.app")


class InFrontWorker:
    """A `WorkerHandle` for an app worker that is a task of the front's event loop."""

    def __init__(self, index: int, task: asyncio.Task) -> None:
        self.index = index
        self.pid = os.getpid()
        self._task = task
        self._loop = task.get_loop()
        self._stopped = threading.Event()  # `wait` is called from another thread
        task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("in-front app worker %d failed", self.index, exc_info=task.exception())
        self._stopped.set()

    def exit_code(self) -> int | None:
        """None while it runs; 0 after a shutdown, 1 if it failed, -15 if it was stopped."""
        task = self._task
        if not task.done():
            return None
        if task.cancelled():
            return -15
        return 1 if task.exception() is not None else 0

    def terminate(self) -> None:
        """Cancel the task: its requests are cancelled and its sockets closed."""
        self._loop.call_soon_threadsafe(self._task.cancel)

    def kill(self) -> None:
        """The same as terminate: a task cannot be killed harder."""
        self.terminate()

    def wait(self, timeout: float) -> int | None:
        """Wait (from a thread other than the loop's) up to `timeout` s for the task to end."""
        return self.exit_code() if self._stopped.wait(timeout) else None


class InFrontLauncher:
    """Starts app workers as tasks of the running (the front's) event loop.

    `app` is the function itself (so closures and objects work, nothing is imported), or
    None to import the spec's `engine.app` reference.
    """

    def __init__(self, app: App | None = None) -> None:
        self._app = app

    worker_host = ""

    def close(self) -> None:
        """Nothing to release: the tasks have ended."""

    def launch(self, spec: WorkerSpec) -> InFrontWorker:
        """Start serving `spec` on the running loop; must be called from that loop."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._serve(spec), name=f"cadence-app-worker-{spec.index}")
        return InFrontWorker(spec.index, task)

    async def _serve(self, spec: WorkerSpec) -> None:
        app = self._app if self._app is not None else load_app(spec.engine.app)
        # No output high-water mark: the reader of these messages is this same loop, so a
        # blocking send would wait for itself.
        if await serve_app(app, spec, output_hwm=0):
            log.warning(
                "in-front app worker %d: the app is still running in an executor "
                "thread; the front will wait for it when it exits",
                spec.index,
            )
