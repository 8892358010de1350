"""The HTTP front against hostile or unlucky clients, from outside over real sockets: values
msgpack cannot hold, nesting bombs, malformed HTTP, slow and stalled readers. Each test names
the fault it guards against (issue 25)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from tests.integration.conftest import start_server
from tests.integration.test_openai import HttpServer

MODEL = "tiny-m"


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Iterator[tuple[HttpServer, Path]]:
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    server = start_server(
        "--served-model-name",
        MODEL,
        "--devices",
        "cpu:1",
        "--step-ms",
        "5",
        "--max-concurrent",
        "64",
        "--log-level",
        "INFO",
        http=True,
        log=log,
    )
    yield server, log
    assert server.stop() == 0


async def _burst(base: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    """Every body POSTed to /v1/completions at once; (status, JSON body) of each, or
    (0, {}) for one that got no answer within 10 s."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def one(body: dict) -> tuple[int, dict]:
            try:
                async with session.post(base + "/v1/completions", json=body) as response:
                    return response.status, json.loads(await response.read())
            except (TimeoutError, aiohttp.ClientError):
                return 0, {}

        return await asyncio.gather(*map(one, bodies))


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("seed", 2**64, "seed"),
        ("seed", -(2**63) - 1, "seed"),
        ("stop_token_ids", [2**70], "stop_token_ids"),
        ("prompt", [1, 2**70], "prompt"),
    ],
)
def test_an_out_of_range_integer_fails_only_its_own_request(logged, field, value, param) -> None:
    server, _ = logged
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    bodies = [dict(good) for _ in range(20)]
    bodies.insert(7, {**good, field: value})
    answers = asyncio.run(_burst(server.base, bodies))
    status, body = answers.pop(7)
    assert status == 400, body
    assert body["error"]["param"] == param and param in body["error"]["message"]
    assert [s for s, _ in answers] == [200] * 20
    # Nothing was left holding an admission slot: a full house is admitted again.
    again = asyncio.run(_burst(server.base, [good] * 64))
    assert [s for s, _ in again] == [200] * 64


def test_seed_at_the_edges_of_64_bits_is_served(logged) -> None:
    server, _ = logged
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    answers = asyncio.run(
        _burst(server.base, [{**good, "seed": 2**64 - 1}, {**good, "seed": -(2**63)}])
    )
    assert [s for s, _ in answers] == [200, 200], answers


def _post_raw(base: str, body: bytes) -> tuple[int, dict]:
    async def run() -> tuple[int, dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.post(
                base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            ) as response:
                return response.status, json.loads(await response.read())

    return asyncio.run(run())


def test_a_nesting_bomb_is_a_400_not_a_traceback(logged) -> None:
    server, log = logged
    depth = 100_000
    for bomb in (
        b'{"model":"tiny-m","prompt":' + b"[" * depth + b"]" * depth + b"}",
        b"[" * depth + b"]" * depth,
    ):
        status, body = _post_raw(server.base, bomb)
        assert status == 400, body
        assert (
            body["error"]["type"] == "invalid_request_error" and "deep" in body["error"]["message"]
        )
    assert "Traceback" not in log.read_text()


async def _exchange(base: str, data: bytes, read_s: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection; everything the server sends until it closes."""
    host, port = base[len("http://") :].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), read_s)
    finally:
        writer.close()


_BODY = b'{"model":"tiny-m","prompt":"Hi","max_tokens":1}'
_MALFORMED = {
    "a header over 8190 bytes": b"X-Big: " + b"a" * 9000 + b"\r\nContent-Length: 47\r\n",
    "10,000 headers": b"".join(b"X-%d: a\r\n" % i for i in range(10_000))
    + b"Content-Length: 47\r\n",
    "Content-Length: -1": b"Content-Length: -1\r\n",
    "Content-Length with Transfer-Encoding": b"Content-Length: 47\r\nTransfer-Encoding: chunked\r\n",
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed_http_is_a_400_in_openai_shape_and_one_log_line(logged, case) -> None:
    server, log = logged
    before = log.read_text().count("\n")
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + _MALFORMED[case]
        + b"\r\n"
        + _BODY
    )
    head, _, body = asyncio.run(_exchange(server.base, request)).partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].endswith(b" 400 Bad Request"), head
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed")
    deadline = time.monotonic() + 5  # the log line is written after the response
    while not (added := log.read_text().splitlines()[before:]):
        assert time.monotonic() < deadline, "nothing was logged"
        time.sleep(0.02)
    assert len(added) == 1 and "refused malformed HTTP" in added[0], added


@pytest.fixture(scope="module")
def impatient(tmp_path_factory) -> Iterator[HttpServer]:
    """A server with short HTTP timeouts and --stall-timeout, one stream at a time."""
    log = tmp_path_factory.mktemp("impatient") / "server.log"
    server = start_server(
        "--served-model-name",
        MODEL,
        "--devices",
        "cpu:1",
        "--step-ms",
        "0",
        "--max-concurrent",
        "1",
        "--max-tokens-limit",
        "1000000",
        "--stall-timeout",
        "1",
        "--http-header-timeout",
        "1",
        "--http-body-timeout",
        "1",
        "--log-level",
        "WARNING",
        http=True,
        log=log,
    )
    yield server
    assert server.stop() == 0


def _server_holds(server: HttpServer, client_ports: set[int]) -> int:
    """How many of the clients' connections (by their local ports) the server still holds."""
    port = int(server.base.rsplit(":", 1)[1])
    held = psutil.Process(server.process.pid).net_connections(kind="tcp")
    return sum(
        1
        for c in held
        if c.laddr.port == port
        and c.raddr
        and c.raddr.port in client_ports
        and c.status == psutil.CONN_ESTABLISHED
    )


def test_slowloris_connections_are_closed_after_the_header_timeout(impatient) -> None:
    async def run() -> None:
        host, port = impatient.base[len("http://") :].rsplit(":", 1)
        connections = [await asyncio.open_connection(host, int(port)) for _ in range(300)]
        for _, writer in connections:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # never ends
        ports = {w.get_extra_info("sockname")[1] for _, w in connections}
        assert await asyncio.to_thread(_server_holds, impatient, ports) > 0
        # Closed by the server: each reader sees the end of its stream.
        await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in connections)), 10)
        for _, writer in connections:
            writer.close()

    asyncio.run(run())


def test_a_body_that_never_arrives_is_refused_and_its_connection_closed(impatient) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n"
    )

    async def refused(request: bytes) -> tuple[float, bytes]:
        """Seconds until the status line came, and all that came before the server closed."""
        host, port = impatient.base[len("http://") :].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            started = time.monotonic()
            writer.write(request)
            first = await asyncio.wait_for(reader.readline(), 5)
            waited = time.monotonic() - started
            return waited, first + await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()

    waited, huge = asyncio.run(refused(head % 10**12 + b"{"))
    assert waited < 0.9  # refused before reading, not at the timeout
    assert b" 413 " in huge.split(b"\r\n")[0] and b"--max-message-bytes" in huge
    waited, slow = asyncio.run(refused(head % 100 + b'{"model":'))
    assert waited >= 0.9 and b" 408 " in slow.split(b"\r\n")[0]
    assert b"--http-body-timeout" in slow


@pytest.mark.slow
def test_a_stalled_reader_is_cut_off_and_its_socket_closed(impatient) -> None:
    body = json.dumps(
        {"model": MODEL, "prompt": "Hi", "max_tokens": 1_000_000, "stream": True}
    ).encode()
    host, port = impatient.base[len("http://") :].rsplit(":", 1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect((host, int(port)))
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    assert client.recv(4096).startswith(b"HTTP/1.1 200")
    ports = {client.getsockname()[1]}
    try:
        # The client reads nothing more. Once the kernel's buffers are full (megabytes on
        # loopback: seconds of output on a busy host) the server's write waits; within
        # --stall-timeout (1 s), the sweep's period and the grace for the last event, the
        # server lets go of the connection.
        deadline = time.monotonic() + 60
        while _server_holds(impatient, ports):
            assert time.monotonic() < deadline, "the server still holds the stalled connection"
            time.sleep(0.1)
        # Nor does its kernel keep the megabytes queued: the client's reads end at once.
        client.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            while client.recv(1 << 20):
                pass
        # Its one slot (--max-concurrent 1) is free again.
        status, _ = asyncio.run(
            _burst(impatient.base, [{"model": MODEL, "prompt": "Hi", "max_tokens": 2}])
        )[0]
        assert status == 200
    finally:
        client.close()


@pytest.mark.parametrize("step_ms", ["2", "20"])
def test_a_client_that_stops_reading_is_cut_off_before_the_kernels_buffers_fill(
    tmp_path, step_ms
) -> None:
    """--stall-timeout whatever the kernel holds: a stream whose client stops reading is cut
    off once the client has acknowledged nothing for the timeout, not once the server's send
    buffer (megabytes on loopback: minutes of output at these step rates) is full."""
    server = start_server(
        "--served-model-name",
        MODEL,
        "--devices",
        "cpu:1",
        "--step-ms",
        step_ms,
        "--max-concurrent",
        "1",
        "--max-tokens-limit",
        "1000000",
        "--stall-timeout",
        "2",
        http=True,
        log=tmp_path / "server.log",
    )
    body = json.dumps(
        {"model": MODEL, "prompt": "Hi", "max_tokens": 1_000_000, "stream": True}
    ).encode()
    host, port = server.base[len("http://") :].rsplit(":", 1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its own buffer fills fast
    try:
        client.connect((host, int(port)))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
        ports = {client.getsockname()[1]}
        deadline = time.monotonic() + 20  # the kernel's buffers: about a minute at 2 ms steps
        while _server_holds(server, ports):
            assert time.monotonic() < deadline, "the server still holds the stalled connection"
            time.sleep(0.1)
        status, _ = asyncio.run(
            _burst(server.base, [{"model": MODEL, "prompt": "Hi", "max_tokens": 2}])
        )[0]
        assert status == 200  # its one slot is free again
    finally:
        client.close()
        assert server.stop() == 0


_TOKEN = "hostile-secret"
_LIMIT = 65536
_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> Iterator[tuple[HttpServer, Path]]:
    """A server with bearer tokens and a 64 KiB body limit, its log in the second item."""
    folder = tmp_path_factory.mktemp("guarded")
    (folder / "tokens").write_text(_TOKEN + "\n")
    log = folder / "server.log"
    server = start_server(
        "--served-model-name",
        MODEL,
        "--devices",
        "cpu:1",
        "--step-ms",
        "0",
        "--auth-token-file",
        str(folder / "tokens"),
        "--max-message-bytes",
        str(_LIMIT),
        "--log-level",
        "INFO",
        http=True,
        log=log,
    )
    yield server, log
    assert server.stop() == 0
    assert "Traceback" not in log.read_text()


class _ResetIsEnd(asyncio.StreamReader):
    """A reader that keeps what came before a reset: the server closes while the client still
    sends (it reads no more of the body), the client's kernel gets a reset, and asyncio's own
    reader would raise it ahead of the response it already holds."""

    def set_exception(self, exc: BaseException) -> None:
        if isinstance(exc, ConnectionResetError):
            self.feed_eof()
        else:
            super().set_exception(exc)


async def _answered(
    base: str, head: bytes, body: bytes = b"", pace_s: float = 0.0
) -> tuple[float, bytes, bytes, int]:
    """Send `head`, then `body` in 64 KiB pieces (`pace_s` apart) while reading: seconds until
    the status line, the response's head, its body, and the body bytes the client got to send
    before the server answered and closed (within 10 s)."""
    host, port = base[len("http://") :].rsplit(":", 1)
    loop = asyncio.get_running_loop()
    reader = _ResetIsEnd(limit=1 << 16, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.create_connection(lambda: protocol, host, int(port))
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    sent = 0

    async def send() -> None:
        nonlocal sent
        with contextlib.suppress(ConnectionError):
            for at in range(0, len(body), 1 << 16):
                writer.write(body[at : at + (1 << 16)])
                await writer.drain()
                sent += len(body[at : at + (1 << 16)])
                await asyncio.sleep(pace_s)

    try:
        started = time.monotonic()
        writer.write(head)
        sender = asyncio.ensure_future(send())
        first = await asyncio.wait_for(reader.readline(), 5)
        waited = time.monotonic() - started
        sent_before = sent
        rest = b""
        with contextlib.suppress(ConnectionError):
            rest = await asyncio.wait_for(reader.read(), 10)  # until the server closes
        sender.cancel()
        response_head, _, response_body = (first + rest).partition(b"\r\n\r\n")
        return waited, response_head, response_body, sent_before
    finally:
        writer.close()


def _error_of(head: bytes, body: bytes, status: int) -> dict:
    assert head.split(b"\r\n")[0].startswith(b"HTTP/1.1 %d " % status), head
    assert b"connection: close" in head.lower(), head  # the unread body is not waited for
    return json.loads(body)["error"]


def test_without_a_token_a_50_mb_body_is_refused_401_before_it_is_read(guarded) -> None:
    server, _ = guarded
    size = 50 * 10**6
    head = _HEAD + b"Content-Length: %d\r\n" % size
    # curl's way for a body over 1 MB: the server must answer 401, not invite the body.
    waited, response, body, _ = asyncio.run(
        _answered(server.base, head + b"Expect: 100-continue\r\n\r\n")
    )
    assert waited < 1.0
    assert _error_of(response, body, 401)["type"] == "authentication_error"
    # A client that sends at once, 64 KiB every 10 ms (5 MB/s: ten seconds for the whole):
    # the answer comes with its first bytes and the connection closes, the rest unread.
    waited, response, body, sent = asyncio.run(
        _answered(server.base, head + b"\r\n", b"x" * size, pace_s=0.01)
    )
    assert waited < 1.0 and sent < 5 * 10**6, (waited, sent)
    assert _error_of(response, body, 401)["code"] == "invalid_api_key"
    # A wrong token too.
    waited, response, body, _ = asyncio.run(
        _answered(
            server.base, head + b"Authorization: Bearer wrong\r\nExpect: 100-continue\r\n\r\n"
        )
    )
    assert waited < 1.0 and _error_of(response, body, 401)["type"] == "authentication_error"


def test_a_body_over_the_limit_is_a_413_in_openai_shape(guarded) -> None:
    server, _ = guarded
    auth = b"Authorization: Bearer %s\r\n" % _TOKEN.encode()
    over = _HEAD + auth + b"Content-Length: %d\r\n" % (_LIMIT + 1)
    for head, body in (
        (over + b"\r\n", b"x" * (_LIMIT + 1)),
        (over + b"Expect: 100-continue\r\n\r\n", b""),
        # No Content-Length: refused once the chunks pass the limit.
        (
            _HEAD + auth + b"Transfer-Encoding: chunked\r\n\r\n",
            b"".join(b"4000\r\n" + b"x" * 0x4000 + b"\r\n" for _ in range(8)),
        ),
    ):
        waited, response, response_body, _ = asyncio.run(_answered(server.base, head, body))
        assert waited < 1.0
        error = _error_of(response, response_body, 413)
        assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
        assert "--max-message-bytes" in error["message"]
    # At the limit, and with Expect, it is served.
    prompt = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    body = prompt[:-1] + b" " * (_LIMIT - len(prompt)) + b"}"
    for expect in (b"", b"Expect: 100-continue\r\n"):
        _, response, response_body, _ = asyncio.run(
            _answered(
                server.base,
                _HEAD
                + auth
                + b"Connection: close\r\n"
                + expect
                + b"Content-Length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        if expect:
            assert response.startswith(b"HTTP/1.1 100 Continue"), response
            response, _, response_body = response_body.partition(b"\r\n\r\n")
        assert response.startswith(b"HTTP/1.1 200 "), response
        assert json.loads(response_body)["usage"]["completion_tokens"] == 2
