"""`cadence serve --grpc-server native`: the front runs inside Envoy's process (pyvoy runs
Python in an Envoy dynamic module), and Envoy's HTTP/2 serves its gRPC port through
`asgi_grpc.GrpcAsgiApp`.

Two sides in two processes:

- `run_in_envoy` runs in the `cadence serve` process. It starts Envoy (`envoy_process`: pyvoy's
  config, the admin interface out of reach) with the ASGI app `app` below, the server's config
  in its environment, and a Unix socket on which
  the front says when it is ready (or why it could not start) and is told to stop. A signal
  here becomes a stop there: the front drains, stops its workers, says so, then Envoy stops.
- `app`, in Envoy's process: its ASGI lifespan starts a `CadenceServer` whose gRPC server is
  the app itself (`GrpcServer(native=app)`), on pyvoy's event loop; its workers are Envoy's
  children. Calls that arrive before the front is ready end UNAVAILABLE.

The HTTP server (`--http-port`) and the metrics endpoint run in Envoy's process too, on the
same loop, as they would in `cadence serve`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import TypedDict

import msgspec

from cadence.config import ServerConfig
from cadence.lifecycle import ServingFailed, StartupError
from cadence.lifecycle.envoy_process import EnvoyProcess, EnvoyStartupError
from cadence.net.asgi_grpc import GrpcAsgiApp
from cadence.wording import counted

log = logging.getLogger("cadence.server")

CONFIG_ENV, CONTROL_ENV = "CADENCE_ENVOY_CONFIG", "CADENCE_ENVOY_CONTROL"
FRONT_ENV = "CADENCE_ENVOY_FRONT"
"""`--fronts N`, fronts 1..N-1: `K BASE_DIR GENERATION` of the front Envoy runs."""
PYTHON_ENV, LOG_LEVEL_ENV = "CADENCE_ENVOY_PYTHON", "CADENCE_ENVOY_LOG_LEVEL"
_STOPPED_WAIT_S = 30.0
"""Beyond the drain (`--drain-timeout`): how long the front may take to stop its workers."""


# --- in `cadence serve`'s process -----------------------------------------------------------


def _free_port(host: str) -> int:
    """A port the OS calls free now; Envoy binds it a moment later (with port 0 the front
    would have to ask Envoy's admin interface which port it got)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def run_in_envoy(
    config: ServerConfig,
    on_started=None,
    log_level: str = "INFO",
    *,
    child: tuple[int, str, int] | None = None,
) -> None:
    """Run the front in Envoy until SIGINT or SIGTERM, then stop it cleanly.

    `child`: (K, BASE_DIR, GENERATION) of front K of `--fronts N` (started by front 0 through
    front_child, stopped by SIGTERM only); its Envoy binds front 0's port beside front 0's
    (Envoy's listeners set SO_REUSEPORT).
    """
    try:
        import pyvoy  # noqa: F401
    except ImportError:
        raise StartupError(
            "--grpc-server native needs the package 'pyvoy', which is not "
            "installed; install it with: pip install 'cadence[native]'"
        ) from None
    port = config.port or _free_port(config.host)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM,) if child else (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    connected: asyncio.Future = loop.create_future()

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not connected.done():
            connected.set_result((reader, writer))

    failed = False
    # The control socket's file is needed only until the front connects: it goes then.
    with tempfile.TemporaryDirectory(prefix="cadence-envoy-", ignore_cleanup_errors=True) as tmp:
        path = os.path.join(tmp, "control")
        control = await asyncio.start_unix_server(on_connect, path)
        tls = {}
        if config.tls_cert:
            assert config.tls_key is not None  # ServerConfig takes --tls-cert only with --tls-key
            tls = {
                "tls_cert": Path(config.tls_cert),
                "tls_key": Path(config.tls_key),
                "tls_enable_http3": False,
            }
            if config.tls_client_ca:
                tls.update(
                    tls_ca_cert=Path(config.tls_client_ca), tls_require_client_certificate=True
                )
        envoy = EnvoyProcess(
            app=f"{__name__}:app",
            address=config.host,
            port=port,
            lifespan=True,
            log_level="error",
            idle_timeout_s=config.idle_connection_timeout_s,
            stderr=None,
            env={
                CONFIG_ENV: msgspec.json.encode(
                    msgspec.structs.replace(config, port=port)
                ).decode(),
                CONTROL_ENV: path,
                PYTHON_ENV: sys.executable,
                LOG_LEVEL_ENV: log_level,
                **({FRONT_ENV: " ".join(map(str, child))} if child else {}),
            },
            killed_with_starter=child is not None,
            **tls,
        )
        try:
            try:
                await envoy.start()
            except EnvoyStartupError as exc:  # Envoy exited; its stderr says why
                raise StartupError(
                    f"Envoy did not start on {config.host}:{port} ({exc}); "
                    "is the port in use? Choose another with --port"
                ) from None
            exited = asyncio.ensure_future(envoy.wait())
            reader, writer = await _first(connected, exited, stop, what="the front to start")
            control.close()
            shutil.rmtree(tmp, ignore_errors=True)
            ready = await _first(reader.readline(), exited, stop, what="the front to start")
            message = json.loads(ready or b'{"error": "the front exited while starting"}')
            if "error" in message:
                raise StartupError(message["error"])
            if on_started is not None:
                on_started(SimpleNamespace(**message["ready"]), port)
            eof = asyncio.ensure_future(reader.readline())
            signalled = asyncio.ensure_future(stop.wait())
            await asyncio.wait((exited, eof, signalled), return_when=asyncio.FIRST_COMPLETED)
            signalled.cancel()
            if not exited.done() and not eof.done():
                writer.write(b"stop\n")
                await writer.drain()
                wait_s = config.drain_timeout_s + _STOPPED_WAIT_S
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(eof, wait_s)
            else:  # nobody here asked it to stop
                failed = True
        except _StoppedDuringStartup:  # as `run_until_signalled`: a stop asked for, exit 0
            log.warning("stopped by a signal during start-up")
        finally:
            await envoy.stop()
            control.close()
    if failed:
        status = exited.result() if exited.done() else "unknown"
        raise ServingFailed(
            f"Envoy stopped while serving on {config.host}:{port} (exit status "
            f"{status}: a crash or a kill); its streams "
            "were cut and the server stopped"
        )


async def _first(awaitable, exited: asyncio.Future, stop: asyncio.Event, what: str):
    """`awaitable`'s result, unless Envoy exits or a signal comes first."""
    task = asyncio.ensure_future(awaitable)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait((task, exited, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    if exited.done():
        raise StartupError(f"Envoy exited (status {exited.result()}) while waiting for {what}")
    raise _StoppedDuringStartup(what)


class _StoppedDuringStartup(Exception):
    """SIGINT or SIGTERM came while the front started; Envoy's stop stops it (`_Front`)."""


# --- in Envoy's process ---------------------------------------------------------------------


class _FrontPlace(TypedDict, total=False):
    """A child front's place among `--fronts N` (CadenceServer's keywords), from FRONT_ENV."""

    front: int
    base_dir: str
    generation: int


class _Front:
    """The lifespan of the front in Envoy: start it beside the lifespan (a slow start would
    hold Envoy's own start-up), report to `run_in_envoy`, stop when told, when `run_in_envoy`
    is gone, or when Envoy stops (Envoy also stops when its parent dies)."""

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None
        self._envoy_stopping: asyncio.Event | None = None

    async def startup(self) -> None:
        # Inside Envoy sys.executable is Envoy: workers start with the Python that started it,
        # without the libpython pyvoy preloads into Envoy.
        sys.executable = os.environ.get(PYTHON_ENV, sys.executable)
        os.environ.pop("LD_PRELOAD", None)
        front = os.environ.get(FRONT_ENV, "0").split(" ")[0]
        logging.basicConfig(
            level=os.environ.get(LOG_LEVEL_ENV, "INFO").upper(),
            format=(
                f"%(asctime)s front-{front} %(name)s %(message)s"
                if front != "0"
                else "%(asctime)s %(name)s %(message)s"
            ),
        )
        self._envoy_stopping = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    async def shutdown(self) -> None:
        """Envoy is stopping: the front stops in order first (drain, workers, sockets)."""
        if self._task is not None and not self._task.done():
            assert self._envoy_stopping is not None  # made with the task
            self._envoy_stopping.set()
            with contextlib.suppress(Exception):
                await self._task

    async def _run(self) -> None:
        from cadence.lifecycle.server import CadenceServer, log_totals, unless_stopped

        envoy_stopping = self._envoy_stopping
        assert envoy_stopping is not None  # made before this task, by startup
        config = msgspec.json.decode(os.environ[CONFIG_ENV], type=ServerConfig)
        reader, writer = await asyncio.open_unix_connection(os.environ[CONTROL_ENV])
        front: _FrontPlace = {}
        if FRONT_ENV in os.environ:
            k, base, generation = os.environ[FRONT_ENV].split(" ")
            front = {"front": int(k), "base_dir": base, "generation": int(generation)}
        server = CadenceServer(config, grpc_app=app, **front)
        orphaned = served = False
        try:
            try:
                # Raced against Envoy's stop (a signal to `run_in_envoy` during a long load):
                # the start is cancelled then, and the stop below stops what it started.
                if await unless_stopped(server.start(), envoy_stopping) is None:
                    return
            except StartupError as exc:
                writer.write(json.dumps({"error": str(exc)}).encode() + b"\n")
                return
            served = True
            writer.write(
                json.dumps(
                    {"ready": {"http_port": server.http_port, "metrics_port": server.metrics_port}}
                ).encode()
                + b"\n"
            )
            await writer.drain()
            # "stop", or b"" once `run_in_envoy` is gone
            told = asyncio.ensure_future(reader.readline())
            stopping = asyncio.ensure_future(envoy_stopping.wait())
            await asyncio.wait((told, stopping), return_when=asyncio.FIRST_COMPLETED)
            orphaned = told.done() and not told.result()
            if not (told.done() and told.result()):
                # `run_in_envoy` did not stop us: it is gone, and Envoy, which stops with it, may
                # end before this stop does. What would be left behind goes first.
                server.unlink_sockets()
            told.cancel()
            stopping.cancel()
            log.info(
                "stopping: %s open, drain timeout %.1f s",
                counted(server.core.active, "stream"),
                config.drain_timeout_s,
            )
        finally:
            await server.stop()
            if served:
                log_totals(server)
            with contextlib.suppress(OSError):
                writer.write(b'{"stopped": true}\n')
                await writer.drain()
                writer.close()
        if orphaned and not envoy_stopping.is_set():
            os.kill(os.getpid(), signal.SIGTERM)  # nobody will stop Envoy: it stops itself


_front = _Front()
app = GrpcAsgiApp()
"""What Envoy runs."""
app.lifespan(_front.startup, _front.shutdown)
