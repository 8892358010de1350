"""A burst of new HTTP connections: the front accepts the whole queue at once, and the lab
tells the connect time apart from the time to first token."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import aiohttp
import uvloop

from cadence.lab.analysis.diagnosis.connection import SLOW_CONNECT_MS
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.openai_http import OpenAITarget
from cadence.lab.load.plan import RequestShape
from cadence.lab.report.run import render_report
from cadence.net.http_listener import Listener
from tests.integration.conftest import start_server


class _Counted(asyncio.Protocol):
    made = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        type(self).made += 1


def test_the_listener_takes_every_queued_connection_at_one_wake_up() -> None:
    """uvloop's own server accepts one connection per loop iteration; the listener takes all
    that wait. The clients connect while the loop is held, so all 64 wait in the kernel's
    queue when the loop next polls."""

    async def main() -> int:
        listener = Listener(_Counted, ssl_context=None, backlog=1024)
        port = await listener.open("127.0.0.1", 0, reuse_port=False)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
        try:
            for _ in range(4):  # the wake-up, the connections' start, their connection_made
                await asyncio.sleep(0)
            return _Counted.made
        finally:
            listener.close()
            for client in clients:
                client.close()

    assert uvloop.run(main()) == 64


async def _connect_p99_ms(connections: int) -> float:
    """The client's own connect time on this host now: `connections` aiohttp connections at
    once, timed as the lab times them, to a listener that never accepts (the kernel completes
    each handshake into its queue). On a loaded host it is the client's loop that is late."""
    times: list[float] = []

    async def start(_session, context, _params) -> None:
        context.started = time.monotonic()

    async def end(_session, context, _params) -> None:
        times.append((time.monotonic() - context.started) * 1e3)

    timer = aiohttp.TraceConfig()
    timer.on_connection_create_start.append(start)
    timer.on_connection_create_end.append(end)
    with socket.create_server(("127.0.0.1", 0), backlog=connections * 2) as listener:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            trace_configs=[timer],
            timeout=aiohttp.ClientTimeout(total=1),
        ) as session:

            async def one() -> None:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    await session.get(url)

            await asyncio.gather(*(one() for _ in range(connections)))
    assert len(times) == connections
    return sorted(times)[int(0.99 * connections)]


def test_a_burst_of_streams_over_http_with_connect_time_apart_from_ttft(tmp_path, capsys) -> None:
    floor_ms = asyncio.run(_connect_p99_ms(384))  # the whole burst's connects, from one loop
    server = start_server(
        "--devices",
        "cpu:2",
        "--step-ms",
        "10",
        "--served-model-name",
        "m",
        "--max-concurrent",
        "512",
        http=True,
    )
    try:
        workload = Workload(
            requests=384,
            concurrency=384,
            shape=RequestShape(max_tokens=(24, 24), prompt_tokens=(8, 8)),
        )
        result = run_bench("", workload, processes=2, protocol=OpenAITarget(server.base, "m"))
    finally:
        assert server.stop() == 0
    floor_ms = max(floor_ms, asyncio.run(_connect_p99_ms(384)))
    assert result.requests_ok == 384, result.errors_by_code
    # Every stream opened its own connection at once, and none was dropped and retried
    # (a SYN retransmit costs its client a whole second).
    assert result.connect_ms.count == 384
    assert result.connect_ms.max < 1000.0
    assert result.ttft_after_connect_ms.count == 384
    for record in result.records:
        assert 0 < record.connect_ns < record.arrival_ns[0] - record.start_ns
    # The connections were not slow: slow_connect does not fire; on a host so loaded that the
    # client's own connect time (to a listener that does nothing) is past half the rule's
    # bound, cadence's connect p99 is within twice that instead.
    if floor_ms < SLOW_CONNECT_MS / 2:
        assert "slow_connect" not in {f.rule for f in result.diagnosis}, floor_ms
    else:
        assert result.connect_ms.p99 < 2 * floor_ms, (result.connect_ms.p99, floor_ms)
    html = render_report(result, tmp_path).read_text()
    assert "connect_ms" in html and "ttft_after_connect_ms" in html
    from cadence.lab.report.summary import print_summary

    print_summary(result)
    out = capsys.readouterr().out
    assert "connect_ms" in out and "ttft_after_connect_ms" in out
