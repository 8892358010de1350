"""The parts of aiohttp that the HTTP front uses beyond its documented API, in one place.

aiohttp offers no public way to do these, and each saves the front something that matters
(a copy of aiohttp's own code, a log line per malformed request, two coroutines per token).
They may change in any aiohttp release: pyproject pins aiohttp to `TESTED`'s minor release,
and tests/unit/test_aiohttp_internals.py checks each one against the installed aiohttp, so
that a newer aiohttp fails there, by name, rather than in a served stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.base_protocol import BaseProtocol
from aiohttp.web_urldispatcher import _default_expect_handler

TESTED = (3, 14)
"""The aiohttp release (major, minor) these parts are checked against; pyproject's pin."""

default_expect_handler = _default_expect_handler
"""aiohttp's own answer to `Expect:` (100 Continue, or 417), for an expect handler that
refuses some requests first and leaves the rest to it."""

CHUNK_FRAME = b"%x\r\n%b\r\n"
"""One piece of a chunked HTTP/1.1 body (`CHUNK_FRAME % (len(data), data)`), as aiohttp's
writer frames it: what `write_eof` ends with its last chunk."""


def connection(
    request: web.BaseRequest,
) -> tuple[asyncio.Transport | None, BaseProtocol, AbstractStreamWriter]:
    """`request`'s connection: its transport, to write a prepared response's body straight to
    it (framed as `CHUNK_FRAME`); its protocol, whose `writing_paused` says the transport's
    buffer is full; and the response's writer, whose `drain` waits until it is not."""
    return request.transport, request.protocol, request.writer


def connection_factory(
    server: web.Server, handler: type[web.RequestHandler]
) -> Callable[[], web.RequestHandler]:
    """What `server()` is (a new connection's protocol), with `handler`, a subclass of aiohttp's
    `RequestHandler`, in place of it: aiohttp has no option for the protocol class, and only
    the protocol answers what the HTTP parser refuses (`RequestHandler.handle_error`)."""
    loop, kwargs = server._loop, server._kwargs
    return lambda: handler(server, loop=loop, **kwargs)
