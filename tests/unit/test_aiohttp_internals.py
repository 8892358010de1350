"""Each part of aiohttp that cadence uses beyond its documented API (cadence.aiohttp_internals),
checked against the installed aiohttp: a release that changes one fails here, naming it."""

from __future__ import annotations

import asyncio
import inspect
import re
import tomllib
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from cadence import aiohttp_internals
from cadence.aiohttp_internals import CHUNK_FRAME, TESTED, connection, connection_factory

_CHANGED = (
    f"aiohttp {aiohttp.__version__} changed a part cadence relies on "
    f"(cadence/aiohttp_internals.py, tested with {TESTED[0]}.{TESTED[1]}): "
)


def test_the_installed_aiohttp_is_the_tested_release_and_pyproject_pins_it() -> None:
    installed = tuple(int(part) for part in aiohttp.__version__.split(".")[:2])
    assert installed == TESTED, (
        f"aiohttp {aiohttp.__version__} is installed; cadence/aiohttp_internals.py is tested "
        f"with {TESTED[0]}.{TESTED[1]}: run this file's tests on it, then move TESTED and the pin"
    )
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())[
        "project"
    ]["dependencies"]
    pin = next(d for d in pyproject if re.match(r"aiohttp\b", d))
    major, minor = TESTED
    assert pin.replace(" ", "") == f"aiohttp>={major}.{minor},<{major}.{minor + 1}", (
        f"pyproject's {pin!r} must pin aiohttp to the tested release {major}.{minor}"
    )


class _Writer:
    def __init__(self) -> None:
        self.written = b""
        self.output_size = 0

    async def write(self, data: bytes) -> None:
        self.written += data
        self.output_size += len(data)


@pytest.mark.parametrize(
    ("expect", "answer"),
    [("100-continue", b"HTTP/1.1 100 Continue\r\n\r\n"), ("something-else", None)],
)
def test_the_default_expect_handler_continues_or_refuses(expect: str, answer) -> None:
    handler = aiohttp_internals.default_expect_handler
    assert inspect.iscoroutinefunction(handler), _CHANGED + "_default_expect_handler"
    writer = _Writer()
    request = make_mocked_request(
        "POST", "/v1/completions", headers={"Expect": expect}, writer=writer
    )
    if answer is None:
        with pytest.raises(web.HTTPExpectationFailed):
            asyncio.run(handler(request))
    else:
        assert asyncio.run(handler(request)) is None, _CHANGED + "_default_expect_handler"
        assert writer.written == answer, _CHANGED + "_default_expect_handler's answer"
        assert writer.output_size == 0, _CHANGED + "_default_expect_handler's output_size"


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""

    def write(self, data) -> None:
        self.written += bytes(data)

    def writelines(self, pieces) -> None:
        for piece in pieces:
            self.write(piece)

    def is_closing(self) -> bool:
        return False


def test_a_chunk_is_framed_as_aiohttps_writer_frames_it() -> None:
    async def framed(data: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        protocol = BaseProtocol(loop)
        transport = _Transport()
        protocol.connection_made(transport)
        writer = StreamWriter(protocol, loop)
        writer.enable_chunking()
        await writer.write_headers("HTTP/1.1 200 OK", {})
        await writer.write(b"")  # the headers go out with the first write
        transport.written = b""
        await writer.write(data)
        return transport.written

    event = b'data: {"choices":[{"text":"hi"}]}\n\n'
    assert asyncio.run(framed(event)) == CHUNK_FRAME % (len(event), event), (
        _CHANGED + "how StreamWriter frames a chunk"
    )


def test_a_requests_connection_parts_are_where_the_sse_writes_expect_them() -> None:
    for name in ("transport", "protocol", "writer"):
        assert isinstance(getattr(web.BaseRequest, name, None), property), (
            _CHANGED + f"BaseRequest.{name}"
        )
    assert isinstance(getattr(BaseProtocol, "writing_paused", None), property), (
        _CHANGED + "BaseProtocol.writing_paused"
    )
    assert inspect.iscoroutinefunction(StreamWriter.drain), _CHANGED + "StreamWriter.drain"
    request = make_mocked_request("GET", "/health")
    transport, protocol, writer = connection(request)
    assert protocol is request.protocol and writer is request.writer
    assert transport is request.transport


class _Handler(web.RequestHandler):
    pass


def test_the_connection_factory_builds_the_servers_protocol_with_its_settings() -> None:
    parameters = list(inspect.signature(web.RequestHandler.handle_error).parameters)
    assert parameters == ["self", "request", "status", "exc", "message"], (
        _CHANGED + f"RequestHandler.handle_error{parameters}"
    )

    async def build() -> None:
        async def handler(request):
            return web.Response()

        server = web.Server(handler, keepalive_timeout=7.5, lingering_time=1.5)
        assert hasattr(server, "_loop") and hasattr(server, "_kwargs"), (
            _CHANGED + "web.Server's _loop and _kwargs"
        )
        made = connection_factory(server, _Handler)()
        plain = server()
        assert type(made) is _Handler and type(plain) is web.RequestHandler
        for name in ("_manager", "_loop", "_keepalive_timeout", "_lingering_time"):
            assert getattr(made, name) == getattr(plain, name), (
                _CHANGED + f"web.Server() builds its protocol with more than _loop and _kwargs "
                f"({name} differs)"
            )
        assert made._keepalive_timeout == 7.5 and made._lingering_time == 1.5

    asyncio.run(build())
