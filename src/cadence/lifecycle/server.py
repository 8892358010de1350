"""The composition root: builds a front's parts in order, starts them, and stops whatever it
started, in reverse.

`CadenceServer.start()` reads as its stages; each stage that starts something pushes how to
stop it onto one `AsyncExitStack`, so `stop()` needs to know nothing about how far `start()`
got. The data path itself (cadence.core, cadence.api) knows nothing of any of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import msgspec

from cadence.api import security
from cadence.api.kserve.service import SERVICE_NAME as KSERVE_SERVICE_NAME
from cadence.api.kserve.service import KServeService
from cadence.api.v1.service import SERVICE_NAME, InferenceService
from cadence.config import ServerConfig, WorkerSpec
from cadence.core.generation import FrontCore
from cadence.core.metrics import FrontMetrics
from cadence.core.output_reader import OutputReader
from cadence.core.tracing import RequestTracer
from cadence.heap import settle_heap
from cadence.lifecycle import StartupError
from cadence.lifecycle.front_children import FrontChildren
from cadence.lifecycle.front_layout import FrontLayout
from cadence.lifecycle.in_front_launcher import InFrontLauncher
from cadence.lifecycle.launcher import Launcher, absent_cards, make_launcher, missing_extra
from cadence.lifecycle.supervisor import WorkerSupervisor, WorkerWatcher
from cadence.net.asgi_grpc import GrpcAsgiApp
from cadence.net.failed_sends import GRPC_LOGGER, count_failed_sends
from cadence.net.grpc_server import GrpcServer
from cadence.router.admission import SharedAdmissionGate
from cadence.router.worker_router import router_for
from cadence.transport.front_channel import FrontChannel
from cadence.transport.messages import StepsFailing, WorkerReady
from cadence.vocabulary import Failure

log = logging.getLogger("cadence.server")

_STARTUP_POLL_S = 0.05
_FINAL_CHUNK_WAIT_S = 1.0
"""After the drain timeout, how long the streams that were ended get to close."""


class CadenceServer:
    """One front process: owns the network, starts and watches one worker per device.

    `start()` returns the bound port once every worker is ready; `stop()` drains, then stops
    what was started in reverse, leaving no process behind. With `--fronts N`, front 0 (this
    class with `front=0`) also starts fronts 1..N-1, each this class in its own process.
    """

    supervisor: WorkerSupervisor | WorkerWatcher
    """Front 0's supervisor of its workers, or a child front's watcher (set by `start`)."""

    def __init__(
        self,
        config: ServerConfig,
        launcher: Launcher | None = None,
        *,
        front: int = 0,
        base_dir: str | None = None,
        generation: int = 0,
        grpc_app: GrpcAsgiApp | None = None,
    ) -> None:
        self.config = config
        self._grpc_app = grpc_app
        """`--grpc-server native`: the ASGI app Envoy serves, in place of a grpc.aio server."""
        self.layout = FrontLayout(config, front, base_dir, generation)
        """`--fronts N`: which front this is, and all that follows from it."""
        self._launcher = launcher
        self._stack = contextlib.AsyncExitStack()
        """How to stop everything started so far, in reverse."""
        self.metrics = FrontMetrics(front=front)
        self.router = router_for(config)
        self.port = 0
        self.http_port: int | None = None
        """The OpenAI-compatible HTTP port (`--http-port`), None without one."""
        self.metrics_port: int | None = None
        self._channel: FrontChannel | None = None
        self._health_updates: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Start the workers and the gRPC server; return the port once serving."""
        config, stack = self.config, self._stack
        loop = asyncio.get_running_loop()
        n = len(config.devices)

        # 1. What the config needs is installed; the launcher (joining a Ray cluster blocks,
        #    harmlessly: nothing serves yet).
        problem = missing_extra(config) or absent_cards(config)
        if problem is not None:
            raise StartupError(problem)
        found = security.problems(config)
        if found:
            raise StartupError("; ".join(found))
        launcher = self._launcher or self._make_launcher()
        stack.push_async_callback(asyncio.to_thread, launcher.close)  # once workers stopped

        # 2. Sockets: the front binds, workers connect.
        layout = self.layout
        channel, gate = layout.bind(
            n, config.worker_host or launcher.worker_host or "127.0.0.1", stack
        )
        links = self._links = channel.links(loop)
        self._channel = channel
        stack.callback(channel.close)

        # 3. The data path: the core, the output reader, the protocol adapters.
        core = self.core = FrontCore(
            config, links, self.router, self.metrics, gate=gate, seq_ids=layout.sequence_ids()
        )
        if config.otlp_traces_endpoint:
            try:
                core.tracer = RequestTracer(
                    config.otlp_traces_endpoint, config.model_name, layout.front
                )
            except RuntimeError as exc:
                raise StartupError(str(exc)) from None
            # Last out: the drain's requests end (and are recorded) before the final export.
            stack.push_async_callback(asyncio.to_thread, core.tracer.close)
        watcher = self._watcher(n, launcher, channel)
        reader = OutputReader(core.streams, self._on_worker_ready, self.metrics, n)
        reader.last_output_ns, reader.last_heard_ns = watcher.last_output_ns, watcher.last_heard_ns
        reader.stalled_ns, reader.on_sick = watcher.stalled_ns, self._on_worker_sick
        reader.handoffs = core.handoffs
        self.metrics.watch_gateway(
            config.model_name, core.requests_waiting, core.requests_running, reader.kv_cache_usage
        )
        channel.start_reading(loop, reader.handle)
        native = self._grpc_app is not None
        v1 = InferenceService(core, layout.metadata(), native=native)
        kserve = KServeService(core, config.model_name, self._serving, native=native)
        self._http = self._http_server(core) if config.http_port is not None else None

        # 4. Metrics: the endpoint, and grpc.aio's failed sends counted instead of logged.
        self._serve_metrics()
        failed_sends = count_failed_sends(self.metrics.failed_sends)
        stack.callback(logging.getLogger(GRPC_LOGGER).removeFilter, failed_sends)

        # 5. The gRPC server, health NOT_SERVING (and requests refused) until workers are ready.
        #    A child front (--fronts N) opens the shared port only once they are: a connection
        #    the kernel gives it (a restarted front's too) never meets a front still starting.
        self._grpc = GrpcServer(
            config,
            {SERVICE_NAME: v1.handlers(), KSERVE_SERVICE_NAME: kserve.handlers()},
            self.metrics,
            native=self._grpc_app,
        )
        if layout.launches_workers:
            await self._open_port()

        # 6. The workers (front 0 launches them; a child front watches front 0's), ready.
        if layout.launches_workers:
            assert isinstance(watcher, WorkerSupervisor)  # front 0 launches and supervises
            self._task(self._beat(channel))
            watcher.launch()
            stack.push_async_callback(watcher.stop, links)
        await self._wait_for_workers(watcher, links)
        if not layout.launches_workers:
            await self._open_port()

        # 7. --fronts N, front 0: the other fronts, ready and watched.
        if layout.launches_fronts:
            shared = (
                msgspec.structs.replace(config, http_port=self.http_port)
                if self.http_port is not None
                else config
            )  # every front: one HTTP port
            assert layout.base is not None  # front 0 made the fronts' folder when it bound
            fronts = FrontChildren(
                shared, layout.base, self.port, on_gone=self._front_gone, on_back=self._front_back
            )
            self.metrics.watch_front_restarts(fronts.restarts)
            self._fronts = fronts
            fronts.launch()
            stack.push_async_callback(fronts.stop)
            await self._while_no_worker_exits(watcher, fronts.wait_ready())
            self._task(fronts.watch())

        # 8. Serve: watch the workers, sweep stalled clients, health SERVING.
        self._task(watcher.run())
        if config.stall_timeout_s is not None:
            self._task(core.sweep_stalled(config.stall_timeout_s))
        stack.push_async_callback(self._drain)  # stopping begins with the drain
        core.refusal = None
        settle_heap()
        await self._refresh_health_now()
        if not layout.launches_workers:
            layout.write_ready_file(self.metrics_port)
        else:
            log.info(
                "serving on %s:%d with %d worker(s) on %s",
                config.host,
                self.port,
                n,
                config.devices,
            )
            if self.http_port is not None:
                log.info(
                    "OpenAI-compatible HTTP on %s:%d, model %r",
                    config.host,
                    self.http_port,
                    config.model_name,
                )
        return self.port

    async def stop(self) -> None:
        """Drain (refuse new requests; open streams get `--drain-timeout` seconds, the rest
        end with UNAVAILABLE), then stop, in reverse, whatever `start()` started."""
        await self._stack.aclose()

    def unlink_sockets(self) -> None:
        """Remove the socket files now, before `stop()` (the workers stay connected): for a
        front whose process may end before its stop does (in Envoy, once `run_in_envoy` died)."""
        if self._channel is not None:
            self._channel.unlink()

    # --- the stages' parts ---------------------------------------------------------------

    async def _open_port(self) -> None:
        self.port = await self._grpc.start()
        self._stack.push_async_callback(self._grpc.stop)
        await self._refresh_health_now()  # NOT_SERVING, and each `cadence.worker.N` known
        if self._http is not None:
            self.http_port = await self._http.start()
            self._stack.push_async_callback(self._http.stop)

    def _http_server(self, core: FrontCore):
        """The OpenAI-compatible HTTP API (`--http-port`): its adapter and its server."""
        from cadence.api.openai.chat import chat_format
        from cadence.api.openai.service import OpenAIService
        from cadence.api.security import read_tokens
        from cadence.net.http_server import HttpServer

        config = self.config
        tokens = read_tokens(config.auth_token_file) if config.auth_token_file else None
        service = OpenAIService(
            core,
            config.model_name,
            self._serving,
            chat_format(config),
            default_max_tokens=config.max_tokens_limit,
            max_body=config.max_message_bytes,
            body_timeout_s=config.http_body_timeout_s,
            tokens=tokens,
            headers=self.layout.metadata(),
        )
        return HttpServer(config, service.app())

    def _make_launcher(self) -> Launcher:
        if self.config.app_in_front:
            return InFrontLauncher()
        try:
            return make_launcher(self.config)
        except RuntimeError as exc:  # no room in the Ray cluster, unreachable: said, not traced
            raise StartupError(str(exc)) from exc

    def _watcher(
        self, n: int, launcher: Launcher, channel: FrontChannel
    ) -> WorkerSupervisor | WorkerWatcher:
        """Front 0's supervisor of the workers it launches, or a child front's watcher."""
        config = self.config
        if not self.layout.launches_workers:
            self.supervisor = WorkerWatcher(
                self.router, n, on_down=self.core.fail_worker, on_health=self._refresh_health
            )
            return self.supervisor
        extra_inputs, front_outputs = self.layout.other_fronts_sockets(n)
        specs = [
            WorkerSpec(
                index=index,
                device=device,
                engine=config.engine,
                input_address=channel.input_addresses[index],
                output_address=channel.output_address,
                extra_input_addresses=extra_inputs[index],
                front_output_addresses=front_outputs,
                heartbeat_address=channel.heartbeat_address,
                heartbeat_interval_s=config.heartbeat_interval_s,
                heartbeat_timeout_s=config.heartbeat_timeout_s,
                curve_server_key=channel.curve_server_key,
                curve_public_key=channel.curve_client_keys[0],
                curve_secret_key=channel.curve_client_keys[1],
                dist_ifname=config.dist_ifname,
                max_prompt_tokens=config.max_prompt_tokens,
                max_failed_steps=config.worker_max_failed_steps,
                role=role,
            )
            for index, (device, role) in enumerate(zip(config.devices, config.roles))
        ]
        supervisor = self.supervisor = WorkerSupervisor(
            launcher,
            specs,
            self.router,
            self._links,
            on_down=self.core.fail_worker,
            on_health=self._refresh_health,
            hang_timeout_s=config.worker_timeout_s,
            restart=config.restart_workers,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
        )
        self.metrics.watch_restarts(
            supervisor.restarts, supervisor.restart_delay_s, supervisor.ejections
        )
        return supervisor

    def _serve_metrics(self) -> None:
        config = self.config
        if config.metrics_port is None:
            return
        if self.layout.launches_workers:
            others = (lambda: self._fronts.metrics_texts()) if self.layout.launches_fronts else None
            self.metrics_port = self.metrics.serve(config.metrics_port, config.host, others)
        else:  # scraped by front 0, which exposes all fronts' metrics together
            self.metrics_port = self.metrics.serve(0, "127.0.0.1")
        self._stack.callback(self.metrics.close)

    def _task(self, coroutine) -> None:
        """Run `coroutine` until the server stops (cancelled then, before what it uses)."""
        task = asyncio.get_running_loop().create_task(coroutine)

        async def cancel() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        self._stack.push_async_callback(cancel)

    async def _beat(self, channel: FrontChannel) -> None:
        """The front's heartbeat: workers that stop hearing it exit (see WorkerHeartbeat).

        Its timer doubles as the event loop's lag probe: how late each wake-up comes is how
        long the loop was busy with other callbacks (cadence_event_loop_lag_seconds)."""
        loop = asyncio.get_running_loop()
        interval = self.config.heartbeat_interval_s
        observe, tally = self.metrics.loop_lag.observe, self.metrics.loop_lag_tally.observe
        while True:
            channel.beat()
            due = loop.time() + interval
            await asyncio.sleep(interval)
            lag = max(0.0, loop.time() - due)
            observe(lag)
            tally(lag)

    async def _wait_for_workers(self, watcher: WorkerSupervisor | WorkerWatcher, links) -> None:
        """Until every worker is ready (and, in a child front, connected to this front's
        sockets); a worker that exits or a timeout fails the start."""
        timeout = self.config.startup_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # A child front binds after the workers connected: it waits until each worker's
        # input socket takes a message (a send before then would be dropped).
        while not (
            all(watcher.ready)
            and (self.layout.launches_workers or all(link.connected() for link in links))
        ):
            _fail_if_a_worker_exited(watcher)
            if loop.time() > deadline:
                missing = [i for i, ready in enumerate(watcher.ready) if not ready]
                raise StartupError(
                    f"workers {missing} were not ready within {timeout:.0f} s; check their "
                    "output above, or raise --startup-timeout for slow model loads"
                )
            await asyncio.sleep(_STARTUP_POLL_S)

    async def _while_no_worker_exits(
        self, watcher: WorkerSupervisor | WorkerWatcher, awaitable
    ) -> None:
        """`awaitable` (a stage after the workers are ready), failed as `_wait_for_workers`
        fails when a worker exits meanwhile: until start-up is over nothing else watches
        them (the supervisor runs from stage 8), and the start must not wait for a dead one."""
        task = asyncio.ensure_future(awaitable)
        try:
            while not task.done():
                _fail_if_a_worker_exited(watcher)
                await asyncio.wait((task,), timeout=_STARTUP_POLL_S)
        finally:
            task.cancel()
        task.result()

    def _on_worker_ready(self, message: WorkerReady) -> None:
        """A worker (first start or restart) is ready: export its start-up, route to it."""
        if message.load_ms or message.warmup_ms:  # zero: an app worker, which measures none
            # Every front gets the same WorkerReady, so each front's page is whole; the
            # values of a restart overwrite the previous start's.
            self.metrics.worker_started(
                message.worker,
                message.load_ms / 1e3,
                message.warmup_ms / 1e3,
                message.first_step_ms / 1e3,
                message.warm_step_ms / 1e3,
            )
        if self.layout.launches_workers:
            log.info(
                "worker %d ready (pid %d, engine %s)", message.worker, message.pid, message.engine
            )
            if message.load_ms or message.warmup_ms:
                # Start-up apart from serving: model load, warm-up, and a cold vs a warm step.
                log.info(
                    "worker %d start-up: load %.0f ms, warm-up %.0f ms (first step %.1f "
                    "ms, warm step %.1f ms)",
                    message.worker,
                    message.load_ms,
                    message.warmup_ms,
                    message.first_step_ms,
                    message.warm_step_ms,
                )
        self.supervisor.mark_ready(message.worker, message.pid)

    def _on_worker_sick(self, message: StepsFailing) -> None:
        """A worker's last steps all failed (--worker-max-failed-steps): every front routes
        around it; front 0 restarts it."""
        self.supervisor.eject(
            message.worker,
            (
                f"worker {message.worker} failed {message.steps} steps in a row (the last: "
                f"{message.message}) and was taken out; retry the request"
            ),
        )

    def _front_gone(self, k: int) -> None:
        """Front k died: its admission slots are free, the workers drop its sequences."""
        gate = self.layout.gate
        assert isinstance(gate, SharedAdmissionGate)  # only fronts > 1 have a front k to lose
        gate.clear(k)
        for link in self._links:
            link.front_gone(k)

    def _front_back(self, k: int) -> None:
        """Front k is being restarted: the workers send to it again."""
        for link in self._links:
            link.front_back(k)

    def _serving(self) -> bool:
        """The server's one health policy, which gRPC health (`""` and the service names), HTTP
        `GET /health` and KServe's ServerReady/ModelReady all answer: a request would be
        admitted now. That is: start-up is over (`refusal` is cleared last), no drain has
        begun, and at least one worker is ready: a load balancer must not take the whole
        server out while one of its workers restarts (`cadence.worker.N` tells each one)."""
        return self.core.refusal is None and any(self.supervisor.ready)

    def _refresh_health(self) -> None:
        if not self.supervisor.stopping:
            task = asyncio.ensure_future(self._refresh_health_now())
            self._health_updates.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(self._health_updates.discard)

    async def _refresh_health_now(self) -> None:
        await self._grpc.set_health(self._serving(), self.supervisor.ready)

    async def _drain(self) -> None:
        """The first step of stopping once serving: other fronts are told to drain too,
        health turns NOT_SERVING, new requests are refused, open streams get the drain's
        time to finish, and the rest end with UNAVAILABLE."""
        if self.layout.launches_fronts:
            self._fronts.terminate()
        await self._grpc.drain()
        core = self.core
        core.refusal = "the server is shutting down; retry on another server"
        loop = asyncio.get_running_loop()
        await self._until_no_streams(loop.time() + self.config.drain_timeout_s)
        core.fail_all(
            Failure.UNAVAILABLE, "the server shut down before this stream finished; retry elsewhere"
        )
        await self._until_no_streams(loop.time() + _FINAL_CHUNK_WAIT_S)

    async def _until_no_streams(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self.core.streams and loop.time() < deadline:
            await asyncio.sleep(0.02)


def _fail_if_a_worker_exited(watcher: WorkerSupervisor | WorkerWatcher) -> None:
    """Start-up's rule: a worker that exits before start-up is over fails the start, in one
    line (the server exits non-zero; whatever runs it starts it again). Once it is over, the
    supervisor restarts such a worker instead."""
    exited = watcher.exited()
    if exited is not None:
        raise StartupError(
            f"worker {exited[0]} exited during start-up (status {exited[1]}); see its output above"
        )


async def unless_stopped(awaitable, stop: asyncio.Event):
    """`awaitable`'s result, or None when `stop` is set first: it is cancelled then (a start
    cancelled half-way leaves on its stack all it started, for `stop()`)."""
    task = asyncio.ensure_future(awaitable)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def run_until_signalled(server: CadenceServer, on_started=None) -> None:
    """Start `server`, serve until SIGINT or SIGTERM, then stop it cleanly. A signal during
    start-up (a model that loads for minutes) stops it too, at once: the start is cancelled
    and `stop()` stops what it had started."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        port = await unless_stopped(server.start(), stop)
        if port is None:
            log.warning("stopped by a signal during start-up")
            return
        if on_started is not None:
            on_started(server, port)
        await stop.wait()
        log.info(
            "stopping: %d stream(s) open, drain timeout %.1f s",
            server.core.active,
            server.config.drain_timeout_s,
        )
    finally:
        await server.stop()


async def run_server(
    config: ServerConfig, on_started=None, launcher: Launcher | None = None
) -> None:
    """`cadence serve`'s body (and `cadence.serve`'s): build a server from `config`, run it until
    SIGINT or SIGTERM, then stop it cleanly. (With `--grpc-server native`,
    `envoy_front.run_in_envoy` instead.)"""
    server = CadenceServer(config, launcher)
    await run_until_signalled(server, on_started)
    log_totals(server)


def log_totals(server: CadenceServer) -> None:
    """The stop's last line: what the server sent over its life."""
    value = server.metrics.registry.get_sample_value
    log.info(
        "stopped: %d chunks, %d tokens, %d steps merged, %d buffer overflows",
        value("cadence_chunks_total"),
        value("cadence_output_tokens_total"),
        value("cadence_merged_steps_total"),
        value("cadence_buffer_overflows_total"),
    )
