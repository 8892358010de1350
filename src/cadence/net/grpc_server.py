"""The front's gRPC server: the protocol adapters' services, health and reflection on one
port, on grpc.aio with the call acceptor that takes new calls in ahead, or on a
`GrpcAsgiApp` that Envoy serves (`--grpc-server native`, see envoy_front)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from cadence.api import security
from cadence.config import ServerConfig
from cadence.core.metrics import FrontMetrics
from cadence.lifecycle import StartupError
from cadence.net.asgi_grpc import UNPARSED, GrpcAsgiApp
from cadence.net.call_acceptor import CallAcceptor
from cadence.proto.kserve.pool import ReflectionPool

log = logging.getLogger("cadence.server")

_FINAL_CHUNK_WAIT_S = 1.0
"""At stop, how long the calls still open get to close."""
_PENDING_CALLS = 10_000
"""Calls gRPC's core holds before the server has asked for them, above which it drops new ones
at random, more the fuller (at three times as many: all): the client of a dropped call sees
CANCELLED, as if it had cancelled. With grpc's own 1,000 (and 3,000), a burst of 2,000 calls on
one connection lost 13-173 of them so; with ten times as many, such a burst reaches cadence's
admission, which refuses what it cannot take with RESOURCE_EXHAUSTED, naming
`--max-concurrent`."""
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


_REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _serve_reflection(server: _Answering | GrpcAsgiApp, services: tuple[str, ...]) -> None:
    """Server reflection as both `grpc.reflection.v1` (what current tools ask first) and
    `v1alpha`. grpcio-reflection ships only v1alpha; v1 is the same protocol renamed, so the
    one servicer answers both, and v1's file joins the pool so that it can be described."""
    _add_v1_reflection_file()
    servicer = reflection.aio.ReflectionServicer(
        (*services, reflection.SERVICE_NAME, _REFLECTION_V1), pool=ReflectionPool()
    )
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_registered_method_handlers(
        _REFLECTION_V1,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            ),
        },
    )


def _add_v1_reflection_file() -> None:
    """grpc/reflection/v1/reflection.proto in protobuf's default pool: v1alpha's file with the
    package renamed (a pool that has it already, from a later grpcio-reflection, keeps its own)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileContainingSymbol(_REFLECTION_V1)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    old, new = f".{file.package}.", ".grpc.reflection.v1."
    file.name, file.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    file.ClearField("options")
    for message in file.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(old, new)
    for method in file.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    pool.Add(file)


_NO_REQUEST = "expected one request message, got none (or one cut short)"


async def _parsed(parse, raw: bytes, context: grpc.aio.ServicerContext) -> object:  # type: ignore[return]  # grpc is untyped: abort() raises
    """`raw` parsed; a message that does not parse ends the call INTERNAL (as on the native
    front, and as grpc-go and grpc-java answer) instead of grpcio's UNKNOWN, which comes with
    a traceback in the log per call, for any client: health needs no token."""
    try:
        return parse(raw)
    except Exception as exc:
        await context.abort(grpc.StatusCode.INTERNAL, f"{UNPARSED}{exc}")


def _reading_its_request(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler`, taking a unary request, served as a request-streaming method that reads and
    parses its one message itself (the wire is the same).

    grpcio's path for a unary request ends a call whose request stream closes with no message
    (an empty body, or a message cut short) without any status, and the client waits for its
    deadline; here such a call ends INTERNAL, as the native front ends it. The responses go
    out as grpc.aio's own path sends them, one `write` each.
    """
    if handler.request_streaming:
        return handler
    parse = handler.request_deserializer

    async def request(context: grpc.aio.ServicerContext) -> object:
        message = await context.read()
        if message is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INTERNAL, _NO_REQUEST)
        return message if parse is None else await _parsed(parse, message, context)

    if handler.response_streaming:
        behavior = handler.unary_stream

        async def stream(requests: object, context: grpc.aio.ServicerContext) -> None:
            responses = behavior(await request(context), context)
            if not hasattr(responses, "__aiter__"):
                await responses  # it writes with context.write
                return
            try:
                async for response in responses:
                    await context.write(response)
            finally:
                # A write that failed, or a cancel, leaves the generator at a yield: closed
                # now, its request's slot with it, not when the loop collects it.
                await responses.aclose()

        return grpc.stream_stream_rpc_method_handler(
            stream, response_serializer=handler.response_serializer
        )
    unary = handler.unary_unary

    async def single(requests: object, context: grpc.aio.ServicerContext) -> object:
        return await unary(await request(context), context)

    return grpc.stream_unary_rpc_method_handler(
        single, response_serializer=handler.response_serializer
    )


def _parsing_its_requests(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler`, taking a stream of requests, given them as bytes that it parses itself
    (see `_parsed`); a unary request is `_reading_its_request`'s."""
    parse = handler.request_deserializer
    if parse is None or not handler.request_streaming:
        return handler

    async def each(requests, context):
        async for raw in requests:
            yield await _parsed(parse, raw, context)

    # grpc.aio tells an async handler from a sync one by its function: each is `async def`.
    if handler.response_streaming:

        async def stream_stream(requests, context):
            async for response in handler.stream_stream(each(requests, context), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(
            stream_stream, response_serializer=handler.response_serializer
        )

    async def stream_unary(requests, context):
        return await handler.stream_unary(each(requests, context), context)

    return grpc.stream_unary_rpc_method_handler(
        stream_unary, response_serializer=handler.response_serializer
    )


def _answering(handlers: dict[str, grpc.RpcMethodHandler]) -> dict[str, grpc.RpcMethodHandler]:
    """`handlers` as the grpc.aio server registers them: every call of every method gets an
    answer, and no client bytes reach grpcio's tracebacks."""
    return {
        method: _reading_its_request(_parsing_its_requests(handler))
        for method, handler in handlers.items()
    }


class _Held:
    drop = False


@contextlib.contextmanager
def _core_log_held() -> Iterator[_Held]:
    """What this process writes to stderr (fd 2, where gRPC core logs) meanwhile, held and
    written out after, unless the caller set `drop`."""
    held = _Held()
    with tempfile.TemporaryFile() as store:
        saved = os.dup(2)
        os.dup2(store.fileno(), 2)
        try:
            yield held
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if not held.drop:
                store.seek(0)
                os.write(2, store.read())


class _Answering:
    """The grpc.aio server as generated `add_*_to_server` functions see it (health's,
    reflection's): what they register goes through `_answering`."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        """Unused: registered methods are matched first, and every method here is registered."""

    def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(name, _answering(handlers))


class GrpcServer:
    """One gRPC server for `services` (full service name -> handlers by method name): grpc.aio,
    or `native`, an ASGI app that Envoy already serves on the configured port."""

    def __init__(
        self,
        config: ServerConfig,
        services: dict[str, dict[str, grpc.RpcMethodHandler]],
        metrics: FrontMetrics,
        native: GrpcAsgiApp | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._native = native
        interceptors = security.server_interceptors(config)
        server: GrpcAsgiApp | grpc.aio.Server
        if native is not None:
            server = native
            native.intercept(interceptors)
            native.max_receive = config.max_message_bytes
        else:
            server = grpc.aio.server(
                options=[
                    ("grpc.so_reuseport", 1 if config.fronts > 1 else 0),
                    ("grpc.max_receive_message_length", config.max_message_bytes),
                    ("grpc.server.max_pending_requests", _PENDING_CALLS),
                    ("grpc.server.max_pending_requests_hard_limit", 3 * _PENDING_CALLS),
                    # A connection with no call open this long gets a GOAWAY and is closed, and
                    # one that never finishes its handshake is closed as soon (grpc's own: 2 min).
                    ("grpc.max_connection_idle_ms", round(config.idle_connection_timeout_s * 1e3)),
                    (
                        "grpc.server_handshake_timeout_ms",
                        round(config.idle_connection_timeout_s * 1e3),
                    ),
                ],
                interceptors=interceptors,
            )
        self._server = server
        registry = server if native is not None else _Answering(server)
        # Registered, not generic: the core then matches calls to methods itself, and the
        # call acceptor can request calls of the streaming methods ahead.
        streaming = {}
        for name, handlers in services.items():
            if native is None:
                handlers = _answering(handlers)
            server.add_registered_method_handlers(name, handlers)
            streaming.update(
                {
                    f"/{name}/{method}": handler
                    for method, handler in handlers.items()
                    if handler.response_streaming
                }
            )
        self._acceptor = (
            CallAcceptor(server, streaming, interceptors, config.accept_ahead)
            if native is None
            else None
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, registry)
        self._names = ("", *services)
        _serve_reflection(registry, (*services, health.SERVICE_NAME))

    async def start(self) -> int:
        """Bind and start, health NOT_SERVING; return the bound port."""
        config = self._config
        await self.set_health(False, [])
        if self._native is not None:
            self._native.open()  # Envoy bound the port before the front started
            port = config.port
        else:
            port = await self._start_aio()
        for warning in security.exposure_warnings(config):
            log.warning("%s", warning)
        return port

    async def _start_aio(self) -> int:
        config = self._config
        server, acceptor = self._server, self._acceptor
        assert not isinstance(server, GrpcAsgiApp) and acceptor is not None  # grpc.aio's own
        address, credentials = f"{config.host}:{config.port}", security.server_credentials(config)
        with _core_log_held() as held:
            try:
                port = (
                    server.add_secure_port(address, credentials)
                    if credentials
                    else server.add_insecure_port(address)
                )
            except RuntimeError:
                port = 0
            held.drop = port == 0  # gRPC core's own line of it; cadence's one line follows
        if port == 0:
            raise StartupError(
                f"could not bind {config.host}:{config.port}; is the port in use? "
                "Choose another with --port (0 picks a free one)"
            )
        await server.start()
        accepting = acceptor.start()
        self._metrics.accept_ahead.set(config.accept_ahead if accepting else 0)
        return port

    async def set_health(self, serving: bool, workers_ready: list[bool]) -> None:
        """The server (`""` and every service name) SERVING or not, as the server's health
        policy decided (`CadenceServer._serving`); `cadence.worker.N` says whether worker N
        is ready (NOT_SERVING while it loads, is down or restarts)."""
        status = _SERVING if serving else _NOT_SERVING
        for name in self._names:
            await self._health.set(name, status)
        for i, up in enumerate(workers_ready):
            await self._health.set(f"cadence.worker.{i}", _SERVING if up else _NOT_SERVING)

    async def drain(self) -> None:
        """Health NOT_SERVING for good (a drain began)."""
        with contextlib.suppress(Exception):
            await self._health.enter_graceful_shutdown()

    async def stop(self) -> None:
        if self._native is not None:
            await self._native.close(_FINAL_CHUNK_WAIT_S)
            return
        server, acceptor = self._server, self._acceptor
        assert not isinstance(server, GrpcAsgiApp) and acceptor is not None  # grpc.aio's own
        await server.stop(_FINAL_CHUNK_WAIT_S)
        acceptor.close()
