"""Builds and runs the front: worker processes, their sockets, and the gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cadence.api.metrics import FrontMetrics
from cadence.api.output_reader import OutputReader
from cadence.api.request_stream import RequestStream
from cadence.api.service import InferenceService
from cadence.api.v1 import inference_pb2 as pb
from cadence.api.v1 import inference_pb2_grpc as pb_grpc
from cadence.config import ServerConfig
from cadence.router import WorkerRouter
from cadence.transport.channel import FrontChannel, local_addresses
from cadence.transport.launcher import Launcher, LocalLauncher, WorkerHandle
from cadence.transport.messages import WorkerReady, WorkerSpec

log = logging.getLogger("cadence.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_MONITOR_INTERVAL_S = 0.2
_FINAL_CHUNK_WAIT_S = 1.0
"""After a drain's grace, how long the streams that were ended get to close."""


class StartupError(RuntimeError):
    """The server could not start; the message says why and what to do."""


class CadenceServer:
    """The front process: owns the network, starts and watches one worker per device.

    `start()` returns the bound port once every worker is ready; `stop()` stops the gRPC
    server with a grace period, then the workers, leaving no process behind.
    """

    def __init__(self, config: ServerConfig, launcher: Launcher | None = None) -> None:
        self.config = config
        self._launcher = launcher or LocalLauncher()
        self._streams: dict[int, RequestStream] = {}
        self._workers: list[WorkerHandle] = []
        self._ready: set[int] = set()
        self._all_ready = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self.port = 0
        self.metrics_port: int | None = None

    async def start(self) -> int:
        """Start the workers and the gRPC server; return the port once serving."""
        config = self.config
        loop = asyncio.get_running_loop()
        n = len(config.devices)

        # Stage 1: sockets. The front binds, workers connect.
        self._channel = FrontChannel(*local_addresses(n, config.transport, config.host))
        links = self._channel.links(loop)

        # Stage 2: routing and the per-request side of the front.
        self.router = WorkerRouter(n)
        self.metrics = FrontMetrics()
        self.service = InferenceService(config, self._streams, links, self.router, self.metrics)
        self._links = links
        self.reader = OutputReader(self._streams, self._on_worker_ready, self.metrics, n)
        if config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(config.metrics_port, config.host)
        self._channel.start_reading(loop, self.reader.handle)

        # Stage 3: the gRPC server, health NOT_SERVING until every worker is ready.
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_InferenceServicer_to_server(self.service, self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            self.port = self._server.add_insecure_port(f"{config.host}:{config.port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise StartupError(
                f"could not bind {config.host}:{config.port}; is the port in use? "
                "Choose another with --port (0 picks a free one)"
            )
        await self._server.start()

        # Stage 4: the workers.
        for index, device in enumerate(config.devices):
            spec = WorkerSpec(
                index=index,
                device=device,
                input_address=self._channel.input_addresses[index],
                output_address=self._channel.output_address,
                engine=config.engine,
            )
            self._workers.append(self._launcher.launch(spec))
        self._tasks.append(loop.create_task(self._monitor_workers()))
        try:
            await asyncio.wait_for(self._all_ready.wait(), config.startup_timeout_s)
        except TimeoutError:
            missing = sorted(set(range(n)) - self._ready)
            raise StartupError(
                f"workers {missing} were not ready within {config.startup_timeout_s:.0f} s; "
                "check their output above, or raise the start-up timeout for slow model loads"
            ) from None
        if self._stopping:
            raise StartupError("a worker exited during start-up; see its output above")
        self.service.refusal = None
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on %s:%d with %d worker(s) on %s", config.host, self.port, n, config.devices)
        return self.port

    def _on_worker_ready(self, message: WorkerReady) -> None:
        self._ready.add(message.worker)
        log.info("worker %d ready (pid %d, engine %s)", message.worker, message.pid, message.engine)
        if len(self._ready) == len(self.config.devices):
            self._all_ready.set()

    async def _until_no_streams(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.02)

    async def _set_health(self, status: int) -> None:
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)

    async def _monitor_workers(self) -> None:
        """Fail every stream of a worker that died, so none is left hanging."""
        dead: set[int] = set()
        while not self._stopping:
            await asyncio.sleep(_MONITOR_INTERVAL_S)
            for worker in self._workers:
                code = worker.exit_code()
                if code is None or worker.index in dead or self._stopping:
                    continue
                dead.add(worker.index)
                self.router.mark_dead(worker.index)
                log.error("worker %d exited with status %s", worker.index, code)
                message = f"worker {worker.index} stopped (exit status {code}); retry the request"
                for stream in list(self._streams.values()):
                    if stream.worker == worker.index:
                        stream.fail(grpc.StatusCode.UNAVAILABLE, message)
                if not self._all_ready.is_set():
                    self._stopping = True
                    self._all_ready.set()  # wake start() so it reports the failure
                    return
                if len(dead) == len(self._workers):
                    await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        """Drain: refuse new requests, let open streams finish for `grace` seconds, end the
        rest with UNAVAILABLE (the client may retry elsewhere), then stop the gRPC server and
        the workers."""
        self._stopping = True
        grace = self.config.grace_s if grace is None else grace
        loop = asyncio.get_running_loop()
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
        self.metrics.close()
        for link in getattr(self, "_links", []):
            with contextlib.suppress(Exception):
                link.shutdown()
        for worker in self._workers:
            if await asyncio.to_thread(worker.wait, 5.0) is None:
                worker.terminate()
                if await asyncio.to_thread(worker.wait, 2.0) is None:
                    worker.kill()
                    await asyncio.to_thread(worker.wait, 2.0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if hasattr(self, "_channel"):
            self._channel.close()


async def serve(config: ServerConfig, on_started=None) -> None:
    """Run a server until SIGINT or SIGTERM, then stop it cleanly."""
    server = CadenceServer(config)
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
