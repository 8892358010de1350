"""gRPC over ASGI with HTTP/2 trailers: the method handlers and interceptors a grpc.aio server
takes, served by an ASGI server that speaks HTTP/2 itself (Envoy, through pyvoy: see
`envoy_front`), so that the HTTP/2 framing, flow control and socket writes are native code
and only the handlers run in Python.

`GrpcAsgiApp` has grpc.aio's registration methods (`add_generic_rpc_handlers`,
`add_registered_method_handlers`), so the code that registers cadence.v1, KServe, health and
reflection with grpc.aio registers them here unchanged, and `AsgiServicerContext` has the part
of grpc.aio's ServicerContext that they use. What the app does of the protocol: one
length-prefixed message per frame, requests compressed with gzip or deflate as grpc.aio reads
them (responses go uncompressed; another `grpc-encoding` is UNIMPLEMENTED); `grpc-timeout` enforced; the status always in trailers after a 200; a reset
stream cancels its handler, as grpc.aio does (see `_Call._watch` for how it is noticed).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from functools import partial
from typing import cast

import grpc

from cadence.wording import counted

log = logging.getLogger("cadence.server")

_RESERVED = frozenset(
    (
        b"content-type",
        b"te",
        b"grpc-timeout",
        b"grpc-encoding",
        b"grpc-accept-encoding",
        b"content-length",
    )
)
"""Request headers that are the protocol's, not the call's metadata."""
_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
"""zlib's window bits for each `grpc-encoding` a request may use."""
_HEADERS = [
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", b"identity,deflate,gzip"),
]
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
WATCH_FIRST_S = 0.02
"""How often a call that has sent nothing yet asks whether its client went away."""
WATCH_IDLE_S = 1.0
"""How often a call that sent before, but nothing since, asks: one that streams a message per
engine step learns of a reset at its next send."""
UNPARSED = "could not parse the request message: "
"""The start of the INTERNAL details of a request message that does not parse, on both gRPC
servers (grpc-go's and grpc-java's answer)."""
_DEADLINE_GRACE_S = 0.1
"""How long past a call's deadline its handler may take to end it itself: cadence's own
handlers end it at the deadline with a status that says what did not finish, as on grpc.aio;
this layer's own DEADLINE_EXCEEDED is for a handler that does not watch its deadline."""
_STOP_FINISH_S = 0.5
"""At `close()`, how long a cancelled call's UNAVAILABLE may take to go out (a client that
reads nothing holds its stream's window shut)."""


def _read_error(future: asyncio.Future) -> None:
    """A send future's error, read so that the loop does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


class AbortError(Exception):
    """Raised by `AsgiServicerContext.abort`: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _ClientGone(Exception):
    """The client reset the stream or closed the connection."""


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: tuple) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


def parse_timeout(value: str) -> float:
    """A `grpc-timeout` header (at most 8 digits and a unit) in seconds."""
    if (
        len(value) < 2
        or len(value) > 9
        or value[-1] not in _TIMEOUT_UNITS
        or not value[:-1].isdigit()
    ):
        raise ValueError(f"malformed grpc-timeout {value!r}")
    return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]


def percent_encode(message: str) -> bytes:
    """`grpc-message` as the gRPC spec writes it: UTF-8 with '%' and every byte outside
    printable ASCII as %XX, nothing else (grpc-js decodes with decodeURI, which would leave
    an encoded ':' or ',' as it is)."""
    return b"".join(
        b"%%%02X" % b if b < 0x20 or b > 0x7E or b == 0x25 else bytes((b,))
        for b in message.encode()
    )


def _metadata(headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str | bytes], ...]:
    out: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name.startswith(b":") or name in _RESERVED:
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            try:
                out.append((key, base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)))
            except binascii.Error:
                # A client's bytes, not the server's fault: grpc.aio's status and words.
                raise AbortError(
                    grpc.StatusCode.INTERNAL,
                    f"Error parsing '{key}' metadata: illegal base64 encoding",
                ) from None
        else:
            out.append((key, value.decode("latin-1")))
    return tuple(out)


def _wire(metadata: Iterable[tuple[str, str | bytes]]) -> list[tuple[bytes, bytes]]:
    out = []
    for key, value in metadata:
        if key.endswith("-bin"):
            value = base64.b64encode(value if isinstance(value, bytes) else value.encode()).rstrip(
                b"="
            )
        out.append(
            (key.encode("latin-1"), value if isinstance(value, bytes) else value.encode("latin-1"))
        )
    return out


class AsgiServicerContext:
    """What cadence's services, grpc_health and grpc_reflection ask of grpc.aio's
    ServicerContext."""

    def __init__(self, call: _Call, metadata: tuple, deadline: float | None, peer: str) -> None:
        self._call = call
        self._metadata = metadata
        self._deadline = deadline
        self._peer = peer
        self._loop = asyncio.get_running_loop()
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.trailing: tuple = ()
        # Not grpc.aio's: writing without awaiting, from the output reader (cadence.v1).
        self.write_now, self.in_flight, self.flushed = call.write_now, call.in_flight, call.flushed

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    def peer(self) -> str:
        return self._peer

    def cancelled(self) -> bool:
        return self._call.gone

    def done(self) -> bool:
        return self._call.ended

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()
    ) -> None:
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise AbortError(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_details(self, details: str) -> None:
        self._details = details

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, metadata: tuple) -> None:
        self.trailing = tuple(metadata)

    async def send_initial_metadata(self, metadata: tuple) -> None:
        await self._call.start(metadata)

    async def write(self, message: object) -> None:
        await self._call.write(message)


class _Call:
    """One gRPC call on one ASGI request: reading its messages, sending its response."""

    __slots__ = (
        "_buffer",
        "_in_flight",
        "_max_receive",
        "_receive",
        "_send",
        "_task",
        "_wbits",
        "body_done",
        "ended",
        "gone",
        "sent",
        "serializer",
        "started",
    )

    def __init__(self, receive, send, max_receive: int) -> None:
        self._receive = receive
        self._wbits: int | None = None
        """zlib's window bits of the request's `grpc-encoding`, for messages flagged compressed."""
        self._send = send
        self.serializer: Callable[[object], bytes] | None = None
        """The method's response serializer, once the method is known."""
        task = asyncio.current_task()
        assert task is not None  # made in its call's own task
        self._task = task
        self._max_receive = max_receive
        self.started = False
        self.sent = 0
        self.body_done = False
        self.gone = False
        self.ended = False
        self._buffer = b""
        self._in_flight: asyncio.Future | None = None
        """What `write_now` handed over last, until taken."""

    async def _next(self) -> dict:
        """The ASGI server's next event. Shielded: pyvoy resolves a receive() future when its
        stream ends, and one that a cancelled call left cancelled raises InvalidStateError
        in the loop's callback, a traceback per call at every stop."""
        return await asyncio.shield(self._receive())

    async def _deliver(self, message: dict) -> None:
        try:
            sent = self._send(message)
            if asyncio.isfuture(sent) and not sent.done():
                # Until Envoy's thread took it (longer while Envoy's buffer for the stream is
                # full). Shielded: a call cancelled meanwhile (its client gone, a stop,
                # --stall-timeout) must not leave pyvoy a cancelled future to resolve, which
                # raises InvalidStateError in the loop's callback (nor its error unread).
                sent.add_done_callback(_read_error)
                await asyncio.shield(sent)
            else:
                await sent
        except Exception as exc:  # the ASGI server's error for a stream the client reset
            self.gone = True
            raise _ClientGone() from exc

    async def start(self, metadata: Iterable = ()) -> None:
        if not self.started:
            self.started = True
            await self._deliver(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "trailers": True,
                    "headers": [*_HEADERS, *_wire(metadata)],
                }
            )

    async def write(self, message: object) -> None:
        if not self.started:
            await self.start()
        # Without a serializer the method's messages are bytes already (grpc's contract).
        data = self.serializer(message) if self.serializer else cast(bytes, message)
        self.sent += 1
        await self._deliver(
            {
                "type": "http.response.body",
                "more_body": True,
                "body": b"\0" + len(data).to_bytes(4, "big") + data,
            }
        )

    def write_now(self, message: object) -> None:
        """Hand `message` to the ASGI server without waiting for it to be taken, once the
        response has started (`flushed()`): the output reader's path, which writes a stream's
        chunk without waking its task. The caller bounds what is handed over untaken (one
        message behind another, then it awaits `flushed()`)."""
        data = self.serializer(message) if self.serializer else cast(bytes, message)  # as in write
        self.sent += 1
        sent = self._send(
            {
                "type": "http.response.body",
                "more_body": True,
                "body": b"\0" + len(data).to_bytes(4, "big") + data,
            }
        )
        if asyncio.isfuture(sent) and not sent.done():
            if self._in_flight is not None:  # handed over behind another: taken in order
                self._in_flight.add_done_callback(_read_error)
            self._in_flight = sent

    def in_flight(self) -> bool:
        """Whether the last message `write_now` handed over is not taken yet (Envoy's thread
        has not got to it, or its buffer for the stream is full). Raises _ClientGone when the
        ASGI server refused it."""
        sent = self._in_flight
        if sent is None:
            return False
        if not sent.done():
            return True
        self._in_flight = None
        if sent.exception() is not None:
            self.gone = True
            raise _ClientGone()
        return False

    async def flushed(self) -> None:
        """Once the response has started and the last message `write_now` handed over is
        taken; raises _ClientGone when the client went."""
        if not self.started:
            await self.start()
        sent, self._in_flight = self._in_flight, None
        if sent is not None:
            sent.add_done_callback(_read_error)
            try:
                await asyncio.shield(sent)  # see _deliver
            except Exception as exc:
                self.gone = True
                raise _ClientGone() from exc

    async def finish(self, code: grpc.StatusCode, details: str, trailing: Iterable) -> None:
        self.ended = True
        if self._in_flight is not None and not self.gone:
            with contextlib.suppress(_ClientGone):
                await self.flushed()
        if self.gone:
            return
        await self.start()
        trailers = [(b"grpc-status", b"%d" % code.value[0]), *_wire(trailing)]
        if details:
            trailers.append((b"grpc-message", percent_encode(details)))
        await self._deliver({"type": "http.response.body", "body": b"", "more_body": False})
        await self._deliver(
            {"type": "http.response.trailers", "headers": trailers, "more_trailers": False}
        )

    async def messages(self) -> AsyncIterator[bytes]:
        """The request's messages as they arrive."""
        while True:
            while len(self._buffer) >= 5:
                compressed = self._buffer[0]
                if compressed and self._wbits is None:
                    raise AbortError(
                        grpc.StatusCode.INTERNAL,
                        "a message flagged compressed without a grpc-encoding",
                    )
                size = int.from_bytes(self._buffer[1:5], "big")
                if size > self._max_receive:
                    raise AbortError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"received message larger than max ({size} vs. {self._max_receive})",
                    )
                if len(self._buffer) < 5 + size:
                    break
                data, self._buffer = self._buffer[5 : 5 + size], self._buffer[5 + size :]
                if compressed:
                    data = self._inflate(data)
                yield data
            if self.body_done:
                if self._buffer:
                    raise AbortError(grpc.StatusCode.INTERNAL, "the request ended inside a message")
                return
            got = await self._next()
            if got["type"] == "http.disconnect":
                # The handler may read its requests in a task of its own: the call ends here,
                # as grpc.aio cancels a call whose client went.
                self.gone = True
                if asyncio.current_task() is not self._task:
                    self._task.cancel()
                raise _ClientGone()
            self._buffer += got.get("body", b"")
            self.body_done = not got.get("more_body", False)

    def encoding(self, name: bytes) -> None:
        """The request's `grpc-encoding`."""
        if name != b"identity":
            if name not in _WBITS:
                raise AbortError(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"grpc-encoding {name.decode('latin-1')} is not supported; use "
                    "gzip, deflate or none",
                )
            self._wbits = _WBITS[name]

    def _inflate(self, data: bytes) -> bytes:
        """A compressed message, inflated to at most the largest message accepted (what it
        inflates to counts, not what it weighs: a small bomb must not fill the memory)."""
        assert self._wbits is not None  # `messages` refuses one without a grpc-encoding
        inflater = zlib.decompressobj(self._wbits)
        try:
            out = inflater.decompress(data, self._max_receive + 1)
        except zlib.error as exc:
            raise AbortError(
                grpc.StatusCode.INTERNAL, f"could not decompress a message: {exc}"
            ) from None
        if len(out) > self._max_receive or inflater.unconsumed_tail:
            raise AbortError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"received message larger than max (over {self._max_receive} bytes "
                "once decompressed)",
            )
        return out

    async def watch(self) -> None:
        """Cancel the handler when the client goes away while the call sends nothing.

        An ASGI server may answer `receive()` after the request body at once until the
        client goes (pyvoy 1.3 answers an empty `http.request`, then `http.disconnect`),
        so waiting on it back to back could spin: it is asked every WATCH_FIRST_S until the
        call's first message, then every WATCH_IDLE_S when nothing went out since the last
        look. A call that sends learns of a reset from its next send.
        """
        last = 0
        while True:
            await asyncio.sleep(WATCH_IDLE_S if self.sent else WATCH_FIRST_S)
            if not self.body_done:
                continue  # the request's reader hears of a reset itself
            if self.sent and self.sent != last:
                last = self.sent  # it sent since the last look: its next send will know
                continue
            if (await self._next())["type"] == "http.disconnect":
                self.gone = True
                self._task.cancel()
                return


def _parser(deserialize: Callable[[bytes], object] | None) -> Callable[[bytes], object]:
    """A method's request deserializer, whose failure on a client's bytes ends the call
    INTERNAL, as grpc-go and grpc-java end it (grpc.aio: UNKNOWN and a traceback in the log
    per call), not as a handler that failed."""
    if deserialize is None:
        return lambda data: data

    def parse(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as exc:
            raise AbortError(grpc.StatusCode.INTERNAL, f"{UNPARSED}{exc}") from None

    return parse


async def _interceptable(find, details: grpc.HandlerCallDetails):
    return find(details)


_STARTING = "the server is starting"
STARTING_WAIT_S = 30.0
"""How long a call that arrives before `open()` waits for it (within its deadline)."""


class GrpcAsgiApp:
    """An ASGI application serving gRPC from grpc.aio-style method handlers.

    A call that arrives before `open()` waits for it (Envoy listens before the front inside it
    is ready, and with `--fronts N` the kernel hands a restarted front new connections at once),
    at most STARTING_WAIT_S, then ends UNAVAILABLE; `close(grace)` refuses new calls and gives
    the open ones `grace` seconds, then cancels them: each ends UNAVAILABLE, as grpc.aio ends
    the calls its stop cancels, and the stop logs one line for them all.
    `lifespan(startup, shutdown)` sets the coroutines the ASGI lifespan runs.
    """

    def __init__(self) -> None:
        self._registered: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._lookup: Callable[[grpc.HandlerCallDetails], Awaitable]
        self.intercept(())
        self._calls: set[asyncio.Task] = set()
        self._refusal: str | None = _STARTING
        self._stopping = False
        """`close()` cancels the calls still open: their CancelledError is the stop's."""
        self._opened: asyncio.Event | None = None
        """Set by `open()`; made on the loop that serves."""
        self._startup: Callable[[], Awaitable[None]] | None = None
        self._shutdown: Callable[[], Awaitable[None]] | None = None
        self.max_receive = 4 << 20

    # --- grpc.aio.Server's registration methods --------------------------------------------

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        for method, handler in handlers.items():
            self._registered[f"/{service}/{method}"] = handler

    def intercept(self, interceptors: Iterable[grpc.aio.ServerInterceptor]) -> None:
        """Run `interceptors` (grpc.aio's) on every call's handler lookup, first one outermost."""
        lookup = partial(_interceptable, self._find)
        for interceptor in reversed(list(interceptors)):
            lookup = partial(interceptor.intercept_service, lookup)
        self._lookup = lookup

    def _find(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._registered.get(details.method)
        if handler is None:
            for generic in self._generic:
                handler = generic.service(details)
                if handler is not None:
                    break
        return handler

    # --- life --------------------------------------------------------------------------------

    def lifespan(
        self, startup: Callable[[], Awaitable[None]], shutdown: Callable[[], Awaitable[None]]
    ) -> None:
        self._startup, self._shutdown = startup, shutdown

    def _opened_event(self) -> asyncio.Event:
        if self._opened is None:
            self._opened = asyncio.Event()
        return self._opened

    def open(self) -> None:
        self._refusal = None
        self._opened_event().set()

    async def close(self, grace_s: float) -> None:
        self._refusal = "the server is stopping"
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=grace_s)
        left = list(self._calls)
        if not left:
            return
        # Health watches, KServe streams with no request in flight, clients that read nothing.
        self._stopping = True
        for task in left:
            task.cancel()
        await asyncio.wait(left, timeout=1.0)
        log.info(
            "stopping: %s still open after the grace ended UNAVAILABLE",
            counted(len(left), "gRPC call"),
        )

    # --- ASGI ----------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._run_lifespan(receive, send)
        if scope["type"] != "http":
            return None
        task = asyncio.current_task()
        assert task is not None  # the ASGI server runs each call in a task
        self._calls.add(task)
        try:
            await self._serve(scope, receive, send)
        except asyncio.CancelledError:
            if not self._stopping:
                raise  # pyvoy's own, which it reports
        finally:
            self._calls.discard(task)
        return None

    async def _run_lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            kind = message["type"]
            if kind == "lifespan.startup":
                if self._startup is not None:
                    await self._startup()
                await send({"type": "lifespan.startup.complete"})
            elif kind == "lifespan.shutdown":
                if self._shutdown is not None:
                    await self._shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _serve(self, scope, receive, send) -> None:
        headers = scope["headers"]
        content_type = next((v for k, v in headers if k == b"content-type"), b"")
        if scope["method"] != "POST" or not content_type.startswith(b"application/grpc"):
            await send(
                {
                    "type": "http.response.start",
                    "status": 415,
                    "headers": [(b"content-type", b"text/plain")],
                }
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": b"this port speaks gRPC: POST with content-type application/grpc\n",
                }
            )
            return
        method = scope["path"]
        call = _Call(receive, send, self.max_receive)
        code, details, trailing = grpc.StatusCode.OK, "", ()
        context = None
        cut_off = False
        try:
            timeout = None
            for name, value in headers:
                if name == b"grpc-timeout":
                    try:
                        timeout = parse_timeout(value.decode("latin-1"))
                    except ValueError as exc:
                        raise AbortError(grpc.StatusCode.INTERNAL, str(exc)) from None
                elif name == b"grpc-encoding":
                    call.encoding(value)
            if self._refusal is _STARTING:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._opened_event().wait(),
                        min(STARTING_WAIT_S, timeout or STARTING_WAIT_S),
                    )
            if self._refusal is not None:
                raise AbortError(grpc.StatusCode.UNAVAILABLE, self._refusal)
            metadata = _metadata(headers)
            handler = await self._lookup(_CallDetails(method, metadata))
            if handler is None:
                raise AbortError(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            client = scope.get("client")
            peer = f"ipv4:{client[0]}:{client[1]}" if client else ""
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            call.serializer = handler.response_serializer
            context = AsgiServicerContext(call, metadata, deadline, peer)
            watcher = asyncio.ensure_future(call.watch())
            try:
                async with asyncio.timeout_at(
                    None if deadline is None else deadline + _DEADLINE_GRACE_S
                ):
                    await self._run(handler, call, context)
            finally:
                watcher.cancel()
            code = context.code() or grpc.StatusCode.OK
            details = context.details()
        except AbortError as exc:
            code, details = exc.code, exc.details
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except _ClientGone:
            call.gone = True
        except asyncio.CancelledError:
            if not call.gone:
                if self._stopping:
                    code, details = grpc.StatusCode.UNAVAILABLE, "the server is stopping"
                else:
                    # The front's own cancel: --stall-timeout cut off a client that reads
                    # nothing. Its status may never get through: the finish below is bounded.
                    task = asyncio.current_task()
                    assert task is not None  # (a task: it was cancelled)
                    task.uncancel()
                    cut_off = True
                    code, details = grpc.StatusCode.CANCELLED, "the server cancelled the call"
        except Exception as exc:
            log.exception("gRPC handler of %s failed", method)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}"
        if context is not None:
            trailing = context.trailing
        try:
            async with asyncio.timeout(_STOP_FINISH_S if self._stopping or cut_off else None):
                await call.finish(code, details, trailing)
        except (_ClientGone, TimeoutError):
            pass
        except asyncio.CancelledError:
            if not self._stopping:
                raise

    async def _run(self, handler: grpc.RpcMethodHandler, call: _Call, context) -> None:
        deserialize = _parser(handler.request_deserializer)
        if handler.request_streaming:

            async def requests():
                async for data in call.messages():
                    yield deserialize(data)

            request = requests()
            run = handler.stream_stream if handler.response_streaming else handler.stream_unary
        else:
            messages = []
            async for data in call.messages():
                messages.append(data)
                if len(messages) > 1:
                    raise AbortError(
                        grpc.StatusCode.UNIMPLEMENTED, "expected one request message, got more"
                    )
            if not messages:
                raise AbortError(grpc.StatusCode.INTERNAL, "expected one request message, got none")
            request = deserialize(messages[0])
            run = handler.unary_stream if handler.response_streaming else handler.unary_unary
        result = run(request, context)
        if handler.response_streaming:
            if hasattr(result, "__aiter__"):
                try:
                    async for response in result:
                        await call.write(response)
                finally:
                    # A send that failed leaves the generator at a yield: close it now (its
                    # request's slot with it), not when the loop collects it.
                    await result.aclose()
            else:
                await result  # it writes with context.write
        else:
            response = await result
            if response is not None:
                await call.write(response)
