"""The OpenAI-compatible HTTP API (aiohttp) in front of cadence's data path.

An adapter like cadence.v1's `Generate`: each request body is mapped to the core's `Request`
(protocol.py; chat messages through chat.py) and opened with `FrontCore.open`, so the same
validation, admission, router, workers, per-request buffers, deadlines, metrics and cleanup
apply; each `Chunk` goes out as one Server-Sent Event (`stream: true`) or joins one JSON body.
Failures become OpenAI-shaped errors with their HTTP status (cadence.api.errors).

- The response starts (status 200 and the SSE headers) with the first chunk, so a request
  that fails before its first token (the deadline, a worker that stopped, the engine's own
  check) still gets its status. A failure after that comes as one `data: {"error": ...}` event
  before `data: [DONE]`.
- A client that disconnects cancels its handler (aiohttp's handler cancellation): the
  `Generation` closes, which aborts the sequence in its worker at the next step.
- A client that reads nothing for `--stall-timeout` is cut off: its error event and `[DONE]`
  go into the socket's buffer, and `_STALLED_CLOSE_S` later the connection is reset (its
  queued output is not kept).
- A request's body must arrive within `--http-body-timeout` (else 408). A request without
  a valid bearer token (401), or whose Content-Length is over `--max-message-bytes` (413), is
  refused on its headers: none of its body is read, no `100 Continue` invites it, and the
  connection closes after the answer. A chunked body is refused with 413 once it passes the
  limit.
- `stop` strings end the output at the first match (the text after it is never sent) and
  the sequence is aborted in the worker; the request counts as OK.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Callable

from aiohttp import HttpVersion11, web

from cadence.aiohttp_internals import CHUNK_FRAME, connection, default_expect_handler
from cadence.api.errors import HTTP_PAYLOAD_TOO_LARGE, HTTP_REQUEST_TIMEOUT, HTTP_UNAUTHENTICATED
from cadence.api.openai.chat import PlainChat, TemplateChat
from cadence.api.openai.protocol import (
    CHAT,
    COMPLETIONS,
    DONE,
    FINISH_REASON,
    Encoder,
    OpenAIRequest,
    StopStrings,
    error_body,
    error_response,
    failure_body,
    models_body,
    parse,
)
from cadence.api.security import BearerTokens, TokenRefusal
from cadence.core.errors import InvalidRequest, RequestError
from cadence.core.generation import FrontCore, Generation
from cadence.core.metrics import OPENAI
from cadence.core.requests import Chunk
from cadence.vocabulary import Failure

_JSON = "application/json"
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
_OPEN_PATHS = ("/health",)
"""Routes that need no bearer token (probes; see cadence.api.security)."""
_TOKEN_REFUSALS = {
    TokenRefusal.MISSING: "this server requires a bearer token: send the header "
    "'Authorization: Bearer <token>'",
    TokenRefusal.MALFORMED: "the Authorization header must be 'Bearer <token>'",
    TokenRefusal.WRONG: "the bearer token is not one this server accepts (see the server's "
    "--auth-token-file)",
    TokenRefusal.SEVERAL: "send one Authorization header: this request carries several",
}
_STALLED_CLOSE_S = 1.0
"""A stream cut off by --stall-timeout: how long its error event and [DONE] wait in the
socket's buffer for the client to read them before the connection is reset."""
_TOO_LARGE = "the request body is larger than this server accepts (--max-message-bytes)"


def _closing(response: web.Response) -> web.Response:
    """`response`, then the connection closes: what the client still sends is not read."""
    response.force_close()
    return response


def _json(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type=_JSON)


def _failure(failure: Failure, message: str) -> web.Response:
    status, body = failure_body(failure, message)
    return _json(body, status)


def _error(exc: RequestError, endpoint: str) -> web.Response:
    status, body = error_response(exc, endpoint)
    return _json(body, status)


def _too_large() -> web.Response:
    status, kind = HTTP_PAYLOAD_TOO_LARGE
    return _closing(_json(error_body(_TOO_LARGE, kind, "request_too_large"), status))


_OPERATIONS = {CHAT: "chat", COMPLETIONS: "text_completion"}
"""Each endpoint's `gen_ai.operation.name` in traces."""


class OpenAIService:
    """Serves the OpenAI-compatible routes for one model, `model_name`, through `core`.

    `ready()`: the server's health policy (GET /health): start-up over, no drain, at least one
    worker ready (cadence.lifecycle.server `CadenceServer._serving`).
    `default_max_tokens`: a chat request's `max_tokens` when it gives none; `max_body`: the
    largest request body (`--max-message-bytes`); `body_timeout_s`: how long a body may take
    to arrive (`--http-body-timeout`); `tokens`: the accepted bearer tokens
    (`--auth-token-file`), or None for no check; `headers`: sent with every streamed
    response (`--fronts N`: which front serves it, as cadence.v1's initial metadata).
    """

    def __init__(
        self,
        core: FrontCore,
        model_name: str,
        ready: Callable[[], bool],
        chat: TemplateChat | PlainChat,
        *,
        default_max_tokens: int,
        max_body: int,
        body_timeout_s: float = 60.0,
        tokens: list[str] | None = None,
        headers: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self.core = core
        self.model_name = model_name
        self._ready = ready
        self._chat = chat
        self._default_max_tokens = default_max_tokens
        self._max_body = max_body
        self._body_timeout_s = body_timeout_s
        self._created = int(time.time())
        self._tokens = BearerTokens(tokens) if tokens else None
        self._sse_headers = {**_SSE_HEADERS, **dict(headers or ())}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_and_auth], client_max_size=self._max_body)
        app.router.add_post("/v1/completions", self.completions, expect_handler=self._expect)
        app.router.add_post(
            "/v1/chat/completions", self.chat_completions, expect_handler=self._expect
        )
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    # --- routes ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def models(self, request: web.Request) -> web.Response:
        return _json(models_body(self.model_name, self._created))

    async def health(self, request: web.Request) -> web.Response:
        if self._ready():
            return _json(b'{"status":"ok"}')
        return _failure(
            Failure.UNAVAILABLE, self.core.refusal or "no worker is ready; retry shortly"
        )

    # --- middleware ------------------------------------------------------------------------

    def _refused_on_headers(self, request: web.Request) -> web.Response | None:
        """The answer to a request refused before any of its body is read: no valid bearer
        token (401), or a Content-Length over --max-message-bytes (413)."""
        if self._tokens is not None and request.path not in _OPEN_PATHS:
            refusal = self._tokens.check(request.headers.getall("Authorization", ()))
            if refusal is not None:
                status, kind = HTTP_UNAUTHENTICATED
                response = _json(
                    error_body(_TOKEN_REFUSALS[refusal], kind, "invalid_api_key"), status
                )
                # Kept alive, the connection would first have to take in the whole body of a
                # client that may send megabytes it has no right to send.
                return _closing(response) if request.body_exists else response
        if request.method == "POST" and (request.content_length or 0) > self._max_body:
            # A client must not hold the connection with a body it will never finish sending.
            self.core.refused(Failure.INVALID_ARGUMENT, OPENAI)
            return _too_large()
        return None

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` (curl's for a body over 1 MB): a request refused on its
        headers gets its answer instead of the `100 Continue` that would invite its body."""
        refused = self._refused_on_headers(request)
        if refused is not None:
            return refused
        await default_expect_handler(request)  # aiohttp's own: 100 Continue, or 417
        return None

    @web.middleware
    async def _errors_and_auth(self, request: web.Request, handler) -> web.StreamResponse:
        refused = self._refused_on_headers(request)
        if refused is not None:
            return refused
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return _failure(
                Failure.NOT_FOUND,
                f"no route {request.path}; this server serves "
                "POST /v1/completions, POST /v1/chat/completions, GET /v1/models "
                "and GET /health",
            )
        except web.HTTPMethodNotAllowed as exc:
            return _json(
                error_body(
                    f"{request.method} is not allowed on {request.path}; use "
                    f"{', '.join(sorted(exc.allowed_methods))}",
                    "invalid_request_error",
                    "method_not_allowed",
                ),
                405,
            )

    # --- generation ------------------------------------------------------------------------

    async def _generate(self, http: web.Request, endpoint: str) -> web.StreamResponse:
        received_ns = time.monotonic_ns()
        core = self.core
        try:
            async with asyncio.timeout(self._body_timeout_s):
                body = await http.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit
            core.refused(Failure.INVALID_ARGUMENT, OPENAI)
            return _too_large()
        except TimeoutError:
            core.refused(Failure.DEADLINE_EXCEEDED, OPENAI)
            status, kind = HTTP_REQUEST_TIMEOUT
            return _closing(
                _json(
                    error_body(
                        f"the request body did not arrive within {self._body_timeout_s:g} s "
                        "(the server's --http-body-timeout)",
                        kind,
                        "request_timeout",
                    ),
                    status,
                )
            )
        try:
            wire = parse(body, endpoint, default_max_tokens=self._default_max_tokens)
            if wire.model != self.model_name:
                raise RequestError(
                    Failure.NOT_FOUND,
                    f"the model {wire.model!r} does not exist "
                    f"here; this server serves {self.model_name!r}",
                    "model",
                )
            if endpoint == CHAT:
                try:
                    wire.request.prompt = self._chat.render(wire.messages)
                except Exception as exc:  # a template's own refusal or error
                    raise InvalidRequest(str(exc), "messages") from None
        except RequestError as exc:
            core.refused(exc.failure, OPENAI)
            return _error(exc, endpoint)
        if core.tracer is not None:
            headers = http.headers
            wire.request.traceparent = headers.get("traceparent", "")
            wire.request.tracestate = headers.get("tracestate", "")
        try:
            generation = core.open(
                wire.request,
                received_ns,
                _time_remaining(wire.timeout_s),
                protocol=OPENAI,
                operation=_OPERATIONS[endpoint],
            )
        except RequestError as exc:  # counted by the core
            return _error(exc, endpoint)
        with generation:
            if wire.stream:
                return await self._stream(http, wire, generation)
            return await self._whole(wire, generation)

    async def _stream(
        self, http: web.Request, wire: OpenAIRequest, generation: Generation
    ) -> web.StreamResponse:
        # The Generation's iterator unrolled into `ready` and `take`. The task writes the first
        # event (the response starts with it) and any that waited; in between, the output
        # reader writes each step's event (`write_from_reader`) and the task sleeps until the
        # stream ends, fails, stops or the client's socket is full.
        ready, take = generation.ready, generation.take
        events = _Events(
            generation,
            Encoder(wire.endpoint, self.model_name, usage_null=wire.include_usage),
            StopStrings(wire.stops) if wire.stops else None,
        )
        response: web.StreamResponse | None = None
        try:
            try:
                while True:
                    waiter = ready()
                    if waiter is not None:
                        await waiter
                    chunk = take()
                    if chunk is None:
                        break
                    if response is None:
                        response = self._sse_response(http)
                        await response.prepare(http)
                        events.attach(http, response)
                    events.emit(chunk)
                    if events.paused:
                        await events.drain()
                    if events.stopped:
                        break
                    await generation.write_from_reader(events.emit)
                    if events.stopped:
                        break
                    if events.paused:
                        await events.drain()
            except RequestError as exc:
                if response is None:
                    return _error(exc, wire.endpoint)
                _, body = error_response(exc, wire.endpoint)
                await response.write_eof(b"data: " + body + b"\n\n" + DONE)
                return response
            if response is None:  # cannot happen: the last chunk always comes
                response = self._sse_response(http)
                await response.prepare(http)
            # The last event(s) and the body's end in one write.
            await response.write_eof(
                events.encoder.usage_event() + DONE if wire.include_usage else DONE
            )
        except ConnectionError:  # the client went away mid-write: the Generation closes
            pass
        except asyncio.CancelledError:
            if response is not None and generation.error is not None:
                await _cut_off(http, response, generation.error)
            raise
        assert response is not None  # made before anything is written (a ConnectionError's source)
        return response

    def _sse_response(self, http: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=self._sse_headers)
        if http.version >= HttpVersion11:
            response.enable_chunked_encoding()  # so that _Events knows to frame chunks
        return response

    async def _whole(self, wire: OpenAIRequest, generation: Generation) -> web.Response:
        encoder = Encoder(wire.endpoint, self.model_name)
        stops = StopStrings(wire.stops) if wire.stops else None
        texts = []
        finish = None
        try:
            async for chunk in generation:
                text, finish, stopped = _text_of(chunk, generation, encoder, stops)
                texts.append(text)
                if stopped:
                    break
        except RequestError as exc:
            return _error(exc, wire.endpoint)
        return _json(encoder.whole("".join(texts), finish))


class _Events:
    """One streamed response's events, written straight to its connection and framed as
    HTTP/1.1 chunks as aiohttp's writer frames them, with no coroutine per event (aiohttp's
    `StreamResponse.write` costs two, and a drain every 64 KiB even when nothing waits).

    `emit` writes one chunk's event, from the task or, between the task's writes, from the
    output reader (`Generation.write_from_reader`); it asks the task to act when a stop string
    matched or the socket's buffer is past its high-water mark (the transport paused the
    protocol), so that the task drains it before anything more is written."""

    __slots__ = (
        "_chunked",
        "_generation",
        "_protocol",
        "_stops",
        "_transport",
        "_writer",
        "encoder",
        "paused",
        "stopped",
    )

    def __init__(self, generation: Generation, encoder: Encoder, stops: StopStrings | None) -> None:
        self._generation = generation
        self.encoder = encoder
        self._stops = stops
        self._transport: asyncio.Transport | None = None
        self._chunked = False
        self.stopped = False
        """A stop string matched: the output ends there."""
        self.paused = False
        """The last write filled the socket's buffer: drain before the next."""

    def attach(self, http: web.Request, response: web.StreamResponse) -> None:
        """The response is prepared (its headers are out): events go to its connection."""
        self._transport, self._protocol, self._writer = connection(http)
        self._chunked = response.chunked

    def emit(self, chunk: Chunk) -> bool:
        """Write `chunk`'s event; True when the task must act first: a stop string matched,
        or the socket's buffer is full (drain). Raises ConnectionResetError when the client's
        connection is closed."""
        text, finish, self.stopped = _text_of(chunk, self._generation, self.encoder, self._stops)
        event = self.encoder.event(text, finish, chunk)
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client's connection is closed")
        transport.write(CHUNK_FRAME % (len(event), event) if self._chunked else event)
        self.paused = self._protocol.writing_paused
        return self.paused or self.stopped

    async def drain(self) -> None:
        self.paused = False
        await self._writer.drain()


async def _cut_off(
    http: web.Request, response: web.StreamResponse, error: tuple[Failure, str]
) -> None:
    """End a stream that the core failed while its write waited on a client that reads nothing
    (--stall-timeout): the error event and [DONE] go into the socket's buffer, and after
    `_STALLED_CLOSE_S` the connection is reset with whatever the client has not taken. A plain
    close would keep the socket, and the megabytes queued in it, for as long as the client
    does not read."""
    transport = http.transport
    if transport is None:
        return
    _, body = failure_body(*error)
    # The event goes into the transport's buffer, and the chunked body's end is left out, as
    # the reset ends it. aiohttp drains past 64 KiB written since its last drain, and a drain
    # waits on the client that reads nothing: the grace bounds the write as well as the wait.
    with contextlib.suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(_STALLED_CLOSE_S):
            await response.write(b"data: " + body + b"\n\n" + DONE)
            await asyncio.sleep(_STALLED_CLOSE_S)  # the client's last chance to read it
    if not transport.is_closing():
        # SO_LINGER 0: the close is a reset, so the kernel does not keep the unsent bytes
        # either (a plain close leaves them queued, the socket orphaned, for minutes).
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()


def _text_of(
    chunk: Chunk, generation: Generation, encoder: Encoder, stops: StopStrings | None
) -> tuple[str, str | None, bool]:
    """A chunk's text and finish reason, counted by `encoder`, with the stop strings applied:
    at a match the text is cut there, the finish is "stop", and the request ends OK (True;
    the core aborts its sequence in the worker when the Generation closes)."""
    encoder.count(chunk)
    finish = FINISH_REASON.get(chunk.finish)
    text = chunk.text
    if stops is not None:
        text = stops.feed(text, finish is not None)
        if stops.matched:
            generation.finish_here()
            return text, "stop", True
    return text, finish, False


def _time_remaining(timeout_s: float | None) -> Callable[[], float | None]:
    """The request's seconds left before its `cadence_timeout_s`, or no deadline."""
    if timeout_s is None:
        return lambda: None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    return lambda: deadline - loop.time()
