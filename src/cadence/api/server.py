"""Builds and runs the front: worker processes, their sockets, and the gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cadence.api import security
from cadence.api.call_acceptor import CallAcceptor
from cadence.api.failed_sends import GRPC_LOGGER, count_failed_sends
from cadence.api.kserve.pool import ReflectionPool
from cadence.api.kserve.service import SERVICE_NAME as KSERVE_SERVICE_NAME
from cadence.api.kserve.service import KServeService
from cadence.api.metrics import FrontMetrics
from cadence.api.output_reader import OutputReader
from cadence.api.request_stream import RequestStream
from cadence.api.service import SERVICE_NAME, InferenceService
from cadence.api.worker_supervisor import WorkerSupervisor
from cadence.config import ServerConfig
from cadence.heap import settle_heap
from cadence.router import WorkerRouter
from cadence.router.admission import SharedAdmissionGate
from cadence.transport.channel import FrontChannel, front_addresses, local_addresses
from cadence.transport.launcher import Launcher, LocalLauncher
from cadence.transport.messages import WorkerReady, WorkerSpec

log = logging.getLogger("cadence.server")

_STARTUP_POLL_S = 0.05
_FINAL_CHUNK_WAIT_S = 1.0
"""After a drain's grace, how long the streams that were ended get to close."""


class StartupError(RuntimeError):
    """The server could not start; the message says why and what to do."""


class CadenceServer:
    """The front process: owns the network, starts and watches one worker per device.

    `start()` returns the bound port once every worker is ready; `stop()` stops the gRPC
    server with a grace period, then the workers, leaving no process behind.
    """

    def __init__(self, config: ServerConfig, launcher: Launcher | None = None, *,
                 front: int = 0, base_dir: str | None = None) -> None:
        self.config = config
        self.front = front
        """`--fronts N`: this front's index; 0 launches the workers and the other fronts."""
        self._base = base_dir
        """`--fronts N`: the private folder of the fronts' sockets, admission counts and ready
        files (front 0 creates it)."""
        self._children: dict[int, subprocess.Popen] = {}
        self._gate: SharedAdmissionGate | None = None
        self._fronts_task: asyncio.Task | None = None
        if launcher is None and config.app_in_front:
            from cadence.worker.in_front import InFrontLauncher

            launcher = InFrontLauncher()
        self._launcher = launcher
        self._streams: dict[int, RequestStream] = {}
        self.supervisor: WorkerSupervisor | None = None
        self._tasks: list[asyncio.Task] = []
        self.port = 0
        self.metrics_port: int | None = None

    async def start(self) -> int:
        """Start the workers and the gRPC server; return the port once serving."""
        config = self.config
        loop = asyncio.get_running_loop()
        n = len(config.devices)

        # Stage 0: the launcher (joining a Ray cluster blocks, harmlessly: nothing serves yet).
        if self._launcher is None:
            self._launcher = _make_launcher(config)

        # Stage 1: sockets. The front binds, workers connect.
        fronts = config.fronts
        if fronts == 1:
            worker_host = (config.worker_host or getattr(self._launcher, "worker_host", "")
                           or "127.0.0.1")
            self._channel = FrontChannel(*local_addresses(n, config.transport, worker_host),
                                         secure=config.transport == "tcp")
        else:
            if self.front == 0:
                self._base = tempfile.mkdtemp(prefix="cadence-")
            self._channel = FrontChannel(*front_addresses(self._base, self.front, n))
            self._gate = SharedAdmissionGate(f"{self._base}/admission", self.front, fronts,
                                             config.max_concurrent)
        links = self._channel.links(loop)

        # Stage 2: routing and the per-request side of the front. With N fronts each routes
        # by its own counts of work (it sees only its own requests).
        self.router = WorkerRouter(n)
        self.metrics = FrontMetrics()
        self._failed_sends = count_failed_sends(self.metrics.failed_sends)
        self.service = InferenceService(config, self._streams, links, self.router, self.metrics,
                                        front=self.front, gate=self._gate)
        # The Open Inference Protocol, on the same port and through the same service.
        self.kserve = KServeService(self.service, config.kserve_model_name, self._serving)
        self._links = links
        self.reader = OutputReader(self._streams, self._on_worker_ready, self.metrics, n)
        if self.front > 0:  # watches the workers front 0 launched (they report to every front)
            from cadence.api.front_child import WorkerWatcher

            self.supervisor = WorkerWatcher(self.router, n, on_down=self._fail_streams_of,
                                            on_health=self._refresh_health)
        if config.metrics_port is not None:
            if self.front == 0:
                self.metrics_port = self.metrics.serve(config.metrics_port, config.host,
                                                       self._child_metrics if fronts > 1 else None)
            else:  # scraped by front 0, which exposes all fronts' metrics together
                self.metrics_port = self.metrics.serve(0, "127.0.0.1")
        self._channel.start_reading(loop, self.reader.handle)

        # Stage 3: the gRPC server, health NOT_SERVING until every worker is ready.
        interceptors = security.server_interceptors(config)
        self._server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 1 if fronts > 1 else 0),
            ("grpc.max_receive_message_length", config.max_message_bytes),
        ], interceptors=interceptors)
        # Registered, not generic: the core then matches calls to methods itself, and the
        # call acceptor can request calls of the streaming methods ahead.
        streaming = {}
        for name, handlers in ((SERVICE_NAME, self.service.handlers()),
                               (KSERVE_SERVICE_NAME, self.kserve.handlers())):
            self._server.add_registered_method_handlers(name, handlers)
            streaming.update({f"/{name}/{method}": handler for method, handler in handlers.items()
                              if handler.response_streaming})
        self._acceptor = CallAcceptor(self._server, streaming, interceptors, config.accept_ahead)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, KSERVE_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self._server, pool=ReflectionPool(),
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            address, credentials = f"{config.host}:{config.port}", security.server_credentials(config)
            self.port = (self._server.add_secure_port(address, credentials) if credentials
                         else self._server.add_insecure_port(address))
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise StartupError(
                f"could not bind {config.host}:{config.port}; is the port in use? "
                "Choose another with --port (0 picks a free one)"
            )
        await self._server.start()
        self._acceptor.start()
        for warning in security.exposure_warnings(config):
            log.warning("%s", warning)

        if self.front > 0:
            await self._start_as_child()
            return self.port

        # Stage 4: the workers, watched (and restarted) by the supervisor once all are ready.
        extra_inputs = [[] for _ in range(n)]
        front_outputs = []
        for k in range(1, fronts):
            inputs, output = front_addresses(self._base, k, n)
            front_outputs.append(output)
            for i in range(n):
                extra_inputs[i].append(inputs[i])
        specs = [
            WorkerSpec(
                index=index,
                device=device,
                input_address=self._channel.input_addresses[index],
                output_address=self._channel.output_address,
                engine=config.engine,
                extra_input_addresses=extra_inputs[index],
                front_output_addresses=front_outputs,
                heartbeat_address=self._channel.heartbeat_address,
                heartbeat_interval_s=config.heartbeat_interval_s,
                heartbeat_timeout_s=config.heartbeat_timeout_s,
                curve_server_key=self._channel.curve_server_key,
                curve_public_key=self._channel.curve_client_keys[0],
                curve_secret_key=self._channel.curve_client_keys[1],
                dist_ifname=config.dist_ifname,
            )
            for index, device in enumerate(config.devices)
        ]
        self._tasks.append(loop.create_task(self._beat()))
        self.supervisor = WorkerSupervisor(
            self._launcher, specs, self.router,
            on_down=self._fail_streams_of, on_health=self._refresh_health,
            hang_timeout_s=config.worker_timeout_s, restart=config.restart_workers,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
        )
        self.reader.last_output_ns = self.supervisor.last_output_ns
        self.reader.last_heard_ns = self.supervisor.last_heard_ns
        self.metrics.watch_restarts(self.supervisor.restarts)
        for k in range(1, fronts):
            self._children[k] = self._launch_front(k)
        await self._wait_for_workers()
        await self._wait_for_fronts()
        if fronts > 1:
            self._fronts_task = loop.create_task(self._watch_fronts())
            self._tasks.append(self._fronts_task)
        self._tasks.append(loop.create_task(self.supervisor.run()))
        if config.stall_timeout_s is not None:
            self._tasks.append(loop.create_task(self.service.sweep_stalled(config.stall_timeout_s)))
        self.service.refusal = None
        settle_heap()
        await self._refresh_health_now()
        log.info("serving on %s:%d with %d worker(s) on %s", config.host, self.port, n, config.devices)
        return self.port

    async def _beat(self) -> None:
        """The front's heartbeat: workers that stop hearing it exit (see WorkerHeartbeat).

        Its timer doubles as the event loop's lag probe: how late each wake-up comes is how
        long the loop was busy with other callbacks (cadence_event_loop_lag_seconds)."""
        loop = asyncio.get_running_loop()
        interval = self.config.heartbeat_interval_s
        observe = self.metrics.loop_lag.observe
        while True:
            self._channel.beat()
            due = loop.time() + interval
            await asyncio.sleep(interval)
            observe(max(0.0, loop.time() - due))

    # --- --fronts N ----------------------------------------------------------------------

    def _launch_front(self, k: int) -> subprocess.Popen:
        """Front k as `python -m cadence.api.front_child`: its own session (Ctrl-C reaches
        front 0 only, which stops it in order) and PDEATHSIG, like a worker."""
        import msgspec

        config = msgspec.structs.replace(self.config, port=self.port)
        return subprocess.Popen(
            [sys.executable, "-m", "cadence.api.front_child", str(k), self._base,
             msgspec.json.encode(config).decode(), str(logging.getLogger().getEffectiveLevel())],
            start_new_session=True,
        )

    async def _wait_for_fronts(self) -> None:
        """Until every other front has written its ready file (it serves by then)."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        for k, child in self._children.items():
            path = f"{self._base}/f{k}-ready"
            while not os.path.exists(path):
                if child.poll() is not None:
                    raise StartupError(f"front {k} exited during start-up (status "
                                       f"{child.returncode}); see its output above")
                if time.monotonic() > deadline:
                    raise StartupError(f"front {k} was not ready within "
                                       f"{self.config.startup_timeout_s:.0f} s")
                await asyncio.sleep(_STARTUP_POLL_S)

    async def _watch_fronts(self) -> None:
        """A front that died ends only its own streams (its clients see the connection
        drop); its admission slots are freed and the workers drop its sequences. It is not
        restarted: the kernel sends new connections to the fronts still listening."""
        while True:
            await asyncio.sleep(0.2)
            for k, child in list(self._children.items()):
                if child.poll() is not None:
                    del self._children[k]
                    log.error("front %d stopped (exit status %s); the other fronts keep serving",
                              k, child.returncode)
                    self._gate.clear(k)
                    for link in self._links:
                        link.front_gone(k)

    def _child_metrics(self) -> list[str]:
        """The /metrics text of every other front (front 0 serves them with its own)."""
        import urllib.request

        texts = []
        for k in sorted(list(self._children)):
            try:
                with open(f"{self._base}/f{k}-ready") as f:
                    port = int(f.read().strip() or 0)
                if port:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                        texts.append((k, r.read().decode()))
            except (OSError, ValueError):
                continue
        return texts

    async def _start_as_child(self) -> None:
        """Front k > 0: no workers of its own; wait until each has said ready to this front,
        then serve and tell front 0 (the ready file holds the metrics port, 0 if none)."""
        await self._wait_for_workers()
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not all(link.connected() for link in self._links):
            if time.monotonic() > deadline:
                raise StartupError(f"front {self.front}: the workers did not connect")
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.supervisor.run()))
        if self.config.stall_timeout_s is not None:
            self._tasks.append(loop.create_task(
                self.service.sweep_stalled(self.config.stall_timeout_s)))
        self.service.refusal = None
        settle_heap()
        await self._refresh_health_now()
        path = f"{self._base}/f{self.front}-ready"
        with open(path + ".tmp", "w") as f:
            f.write(str(self.metrics_port or 0))
        os.replace(path + ".tmp", path)

    async def _stop_fronts(self) -> None:
        """Front 0's shutdown: SIGTERM every other front, which drains like front 0."""
        children = list(self._children.values())
        self._children.clear()
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                await asyncio.to_thread(child.wait, self.config.grace_s + 5.0)
            except subprocess.TimeoutExpired:
                child.kill()
                await asyncio.to_thread(child.wait)

    async def _wait_for_workers(self) -> None:
        """Until every worker is ready; a worker that exits or a timeout fails the start."""
        supervisor, timeout = self.supervisor, self.config.startup_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        while not all(supervisor.ready):
            for worker in supervisor.workers:
                if worker.exit_code() is not None:
                    raise StartupError(f"worker {worker.index} exited during start-up (status "
                                       f"{worker.exit_code()}); see its output above")
            if asyncio.get_running_loop().time() > deadline:
                missing = [i for i, ready in enumerate(supervisor.ready) if not ready]
                raise StartupError(
                    f"workers {missing} were not ready within {timeout:.0f} s; check their "
                    "output above, or raise --startup-timeout for slow model loads"
                )
            await asyncio.sleep(_STARTUP_POLL_S)

    def _on_worker_ready(self, message: WorkerReady) -> None:
        """A worker (first start or restart) is ready: export its start-up, route to it."""
        if message.load_ms or message.warmup_ms:  # zero: an app worker, which measures none
            # Every front gets the same WorkerReady, so each front's page is whole; the
            # values of a restart overwrite the previous start's.
            self.metrics.worker_started(message.worker, message.load_ms / 1e3,
                                        message.warmup_ms / 1e3, message.first_step_ms / 1e3,
                                        message.warm_step_ms / 1e3)
        if self.front > 0:
            self.supervisor.mark_ready(message.worker, message.pid)
            return
        log.info("worker %d ready (pid %d, engine %s)", message.worker, message.pid, message.engine)
        if message.load_ms or message.warmup_ms:
            # Start-up apart from serving: model load, warm-up, and a cold vs a warm step.
            log.info(
                "worker %d start-up: load %.0f ms, warm-up %.0f ms (first step %.1f ms, warm "
                "step %.1f ms)", message.worker, message.load_ms, message.warmup_ms,
                message.first_step_ms, message.warm_step_ms,
            )
        self.supervisor.mark_ready(message.worker)

    def _fail_streams_of(self, worker: int, message: str) -> None:
        for stream in list(self._streams.values()):
            if stream.worker == worker:
                stream.fail(grpc.StatusCode.UNAVAILABLE, message)

    def _serving(self) -> bool:
        """Requests are taken: start-up is over, no drain, at least one worker ready."""
        return (self.service.refusal is None and self.supervisor is not None
                and any(self.supervisor.ready))

    def _refresh_health(self) -> None:
        if self.supervisor is not None and not self.supervisor.stopping:
            self._tasks.append(asyncio.ensure_future(self._refresh_health_now()))

    async def _refresh_health_now(self) -> None:
        """The server is SERVING while at least one worker is ready; `cadence.worker.N` says
        whether worker N is (NOT_SERVING while it is down or restarting)."""
        serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                                health_pb2.HealthCheckResponse.NOT_SERVING)
        ready = self.supervisor.ready
        await self._set_health(serving if any(ready) else not_serving)
        for i, up in enumerate(ready):
            await self._health.set(f"cadence.worker.{i}", serving if up else not_serving)

    async def _until_no_streams(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.02)

    async def _set_health(self, status: int) -> None:
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)
        await self._health.set(KSERVE_SERVICE_NAME, status)

    async def stop(self, grace: float | None = None) -> None:
        """Drain: refuse new requests, let open streams finish for `grace` seconds, end the
        rest with UNAVAILABLE (the client may retry elsewhere), then stop the gRPC server and
        the workers."""
        grace = self.config.grace_s if grace is None else grace
        loop = asyncio.get_running_loop()
        if self._fronts_task is not None:
            self._fronts_task.cancel()  # a front stopped from now on is no failure
        fronts_stopped = (loop.create_task(self._stop_fronts()) if self._children else None)
        if hasattr(self, "_health"):
            with contextlib.suppress(Exception):
                await self._health.enter_graceful_shutdown()
        if hasattr(self, "service"):
            self.service.refusal = "the server is shutting down; retry on another server"
            await self._until_no_streams(loop.time() + grace)
            for stream in list(self._streams.values()):
                stream.fail(grpc.StatusCode.UNAVAILABLE,
                            "the server shut down before this stream finished; retry elsewhere")
            await self._until_no_streams(loop.time() + _FINAL_CHUNK_WAIT_S)
        if hasattr(self, "_server"):
            await self._server.stop(_FINAL_CHUNK_WAIT_S)
            self._acceptor.close()
        if hasattr(self, "metrics"):
            self.metrics.close()
            logging.getLogger(GRPC_LOGGER).removeFilter(self._failed_sends)
        if fronts_stopped is not None:
            await fronts_stopped  # their streams need the workers until they end
        if self.supervisor is not None:
            await self.supervisor.stop(self._links)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if hasattr(self, "_channel"):
            self._channel.close()
        close_launcher = getattr(self._launcher, "close", None)
        if close_launcher is not None:
            await asyncio.to_thread(close_launcher)
        if self.front == 0 and self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)


def _make_launcher(config: ServerConfig) -> Launcher:
    """The launcher `config` names: local processes, or Ray actors (`--launcher ray`)."""
    if config.launcher == "ray":
        from cadence.transport.ray_launcher import RayLauncher

        try:
            return RayLauncher(config)
        except RuntimeError as exc:  # no Ray, or no room in the cluster: said, not traced
            raise StartupError(str(exc)) from exc
    return LocalLauncher()


async def serve(config: ServerConfig, on_started=None, launcher: Launcher | None = None) -> None:
    """Run a server until SIGINT or SIGTERM, then stop it cleanly."""
    server = CadenceServer(config, launcher)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        port = await server.start()
        if on_started is not None:
            on_started(server, port)
        await stop.wait()
        log.info("stopping: %d stream(s) open, grace %.1f s", server.service.active, config.grace_s)
    finally:
        await server.stop()
    value = server.metrics.registry.get_sample_value
    log.info(
        "stopped: %d chunks, %d tokens, %d steps merged, %d buffer overflows",
        value("cadence_chunks_total"), value("cadence_output_tokens_total"),
        value("cadence_merged_steps_total"), value("cadence_buffer_overflows_total"),
    )
