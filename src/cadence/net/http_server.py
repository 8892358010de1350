"""The front's HTTP server (aiohttp, on the front's own event loop): the OpenAI-compatible
routes on `--http-port`, with the gRPC port's TLS settings; with `--fronts N` every front
binds the same port (SO_REUSEPORT), as for gRPC. Its connections are accepted by
`http_listener.Listener`, which takes a whole burst at once, not one per loop iteration."""

from __future__ import annotations

import logging
import ssl

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from cadence.aiohttp_internals import connection_factory
from cadence.api.openai.protocol import error_body
from cadence.config import ServerConfig
from cadence.lifecycle import StartupError
from cadence.net.http_listener import Listener

log = logging.getLogger("cadence.http")

_BACKLOG = 4096
"""Connections the kernel queues before the loop accepts them (capped by net.core.somaxconn).
HTTP/1.1 takes one connection per stream, so a burst of new streams is a burst of connects:
aiohttp's default of 128 would overflow, and each dropped SYN costs its client a 1 s
retransmit. It is also the most connections accepted at one wake-up of the port."""
_LINGER_S = 2.0
"""After a response to a request whose body was not read (refused as too large, or too slow),
how long the rest is read and dropped before the connection closes, so that the client gets
the response rather than a reset; aiohttp's default of 10 s would let it hold the socket longer."""
_SHUTDOWN_S = 1.0
"""At stop (after the drain), how long the handlers still open get to end."""


def ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """TLS for the HTTP port from `--tls-cert` / `--tls-key` (and `--tls-client-ca`: mutual
    TLS), or None for plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=config.tls_client_ca)
    return context


class _Connection(web.RequestHandler):
    """aiohttp's per-connection protocol, answering what its parser refuses (a line over
    8190 bytes, over 128 headers, a bad Content-Length, Content-Length with Transfer-Encoding)
    in OpenAI's error shape with one log line, where aiohttp's own answer is plain text and a
    traceback at ERROR: any client could flood the log with them. aiohttp has no option for
    its parser's error response, nor for the protocol class (`connection_factory`)."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        what = " ".join((exc.message or "").split())  # the parser's message spans lines
        log.info("refused malformed HTTP from %s: %s", request.remote, what)
        response = web.Response(
            status=exc.code or 400,
            content_type="application/json",
            body=error_body(
                f"malformed HTTP request: {what}", "invalid_request_error", "malformed_request"
            ),
        )
        response.force_close()
        return response


class HttpServer:
    """One aiohttp server for `app` on `config.host:config.http_port`."""

    def __init__(self, config: ServerConfig, app: web.Application) -> None:
        self._config = config
        # Handler cancellation: a client that disconnects cancels its request's handler, so
        # its Generation closes and the worker drops the sequence at its next step.
        # keepalive_timeout is aiohttp's idle timer, which runs from the connection's start
        # and between requests until a whole request's headers are in: the header timeout,
        # and the idle connection timeout, whichever is shorter.
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_S,
            keepalive_timeout=min(config.http_header_timeout_s, config.idle_connection_timeout_s),
            lingering_time=_LINGER_S,
        )
        self._listener: Listener | None = None

    async def start(self) -> int:
        """Bind and start; return the bound port."""
        config = self._config
        await self._runner.setup()
        assert self._runner.server is not None
        listener = Listener(
            connection_factory(self._runner.server, _Connection),
            ssl_context=ssl_context(config),
            backlog=_BACKLOG,
            stall_timeout_s=config.stall_timeout_s,
        )
        try:
            port = await listener.open(
                config.host, config.http_port or 0, reuse_port=config.fronts > 1
            )
        except OSError as exc:
            await self._runner.cleanup()
            raise StartupError(
                f"could not bind {config.host}:{config.http_port} for HTTP "
                f"({exc.strerror or exc}); choose another --http-port (0 picks "
                "a free one)"
            ) from None
        self._listener = listener
        return port

    async def stop(self) -> None:
        """Stop accepting, then end the open connections (aiohttp's shutdown)."""
        if self._listener is not None:
            self._listener.close()
        await self._runner.cleanup()
