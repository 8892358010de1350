"""Which HTTP stack for the OpenAI-compatible front (issue 18, must-have 4): the server's CPU
per streamed event of each candidate against grpc.aio's, on the same burst workload.

Each candidate is a bare server with no cadence code, on uvloop (cadence.event_loop), in its
own process: `--streams` streams of `--events` events each, all woken at one instant per
`--step-ms` step (as cadence's workers deliver a step's tokens), each writing one event of
the size of an OpenAI chat chunk. A client process (aiohttp's client for HTTP, grpc.aio for
gRPC) opens every stream at once and reads them to the end. The server's CPU seconds (user +
system, psutil) over the run, divided by the events it sent, is the cost per event; the gap
between a step's wake-up and each event's arrival at the client says whether a step's burst
is finished inside the step (each event carries its step's wake-up time).

    flock /tmp/cadence-bench.lock python benchmarks/http_library.py \
        [--out results/http_library.json] [--streams 256] [--events 128] [--step-ms 20]

The uvicorn candidate needs `pip install uvicorn httptools` (not a dependency of cadence;
`--only aiohttp protocol grpc` leaves it out).

Candidates: aiohttp (web.StreamResponse), uvicorn with httptools (a raw ASGI app), a bare
asyncio.Protocol writing SSE (the floor), and grpc.aio (generic handler, bytes in and out).
granian is not a candidate: it runs the application on event loops of its own in worker
processes it starts, not on the front's loop that the core, the output reader and the gRPC
server share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil

from cadence import event_loop

sys.path.insert(0, str(Path(__file__).parent))
from sse_reference import Ticker

_HEAD = b'{"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.chunk",'
_TAIL = b',"model":"cadence","choices":[{"index":0,"delta":{"content":"A"},"finish_reason":null}]}'


def payload(tick_ns: int) -> bytes:
    """An OpenAI chat chunk whose `created` field carries the step's wake-up time (ns)."""
    return _HEAD + b'"created":%d' % tick_ns + _TAIL


def sse(tick_ns: int) -> bytes:
    return b"data: " + payload(tick_ns) + b"\n\n"


CANDIDATES = ("aiohttp", "uvicorn", "protocol", "grpc")


async def _serve_aiohttp(ticker: Ticker, events: int) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for _ in range(events):
            await response.write(sse(await ticker.wait()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/stream", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    _announce(site._server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()


async def _serve_uvicorn(ticker: Ticker, events: int) -> None:
    import socket

    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for _ in range(events):
            body = sse(await ticker.wait())
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, http="httptools", loop="none", lifespan="off", access_log=False, log_level="warning"
    )
    server = uvicorn.Server(config)
    _announce(sock.getsockname()[1])
    await server.serve(sockets=[sock])


async def _serve_protocol(ticker: Ticker, events: int) -> None:
    """The floor: an asyncio.Protocol that answers any request with a chunked SSE stream."""

    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    done = b"data: [DONE]\n\n"
    tail = b"%x\r\n" % len(done) + done + b"\r\n0\r\n\r\n"

    class Stream(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.buffer = b""

        def data_received(self, data):
            self.buffer += data
            if b"\r\n\r\n" in self.buffer and self.buffer.endswith(b"}"):
                self.buffer = b""
                asyncio.ensure_future(self.run())

        async def run(self):
            self.transport.write(head)
            for _ in range(events):
                event = sse(await ticker.wait())
                self.transport.write(b"%x\r\n" % len(event) + event + b"\r\n")
            self.transport.write(tail)

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Stream, "127.0.0.1", 0)
    _announce(server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()


async def _serve_grpc(ticker: Ticker, events: int) -> None:
    import grpc

    async def stream(request: bytes, context):
        for _ in range(events):
            yield payload(await ticker.wait())

    handler = grpc.method_handlers_generic_handler(
        "bench.Stream", {"Run": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    _announce(port)
    await server.wait_for_termination()


def _announce(port: int) -> None:
    print(port, flush=True)


def serve(kind: str, step_ms: float, events: int) -> None:
    ticker = Ticker(step_ms / 1e3)
    servers = {
        "aiohttp": _serve_aiohttp,
        "uvicorn": _serve_uvicorn,
        "protocol": _serve_protocol,
        "grpc": _serve_grpc,
    }
    event_loop.run(servers[kind](ticker, events))


# --- client ----------------------------------------------------------------------------------


async def _client(kind: str, port: int, streams: int) -> dict:
    """Open every stream at once; return each event's delay from its step's wake-up (ns)."""
    delays: list[int] = []
    add = delays.append
    if kind == "grpc":
        import grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/bench.Stream/Run")

            async def one(i: int) -> None:
                async for message in call(b"{}"):
                    now = time.monotonic_ns()
                    add(now - int(message[message.index(b'"created":') + 10 :].split(b",")[0]))

            await asyncio.gather(*(one(i) for i in range(streams)))
    else:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(i: int) -> None:
                async with session.post(f"http://127.0.0.1:{port}/stream", json={}) as response:
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            now = time.monotonic_ns()
                            add(now - int(line[line.index(b'"created":') + 10 :].split(b",")[0]))

            await asyncio.gather(*(one(i) for i in range(streams)))
    return {"events": len(delays), "delays": delays}


def _delay_ms(delays: list[int]) -> dict:
    """Event delay from its step's wake-up in the server to its arrival in the client."""
    ms = sorted(d / 1e6 for d in delays)
    pick = lambda q: round(ms[min(len(ms) - 1, int(q * len(ms)))], 3)  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "max": round(ms[-1], 3)}


def measure(kind: str, streams: int, events: int, step_ms: float) -> dict:
    server = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            kind,
            "--step-ms",
            str(step_ms),
            "--events",
            str(events),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        process = psutil.Process(server.pid)
        time.sleep(0.5)  # imports done, the loop idle
        before = sum(process.cpu_times()[:2])
        started = time.monotonic()
        result = event_loop.run(_client(kind, port, streams))
        wall = time.monotonic() - started
        cpu = sum(process.cpu_times()[:2]) - before
    finally:
        server.kill()
        server.wait()
    n = result["events"]
    return {
        "events": n,
        "expected": streams * events,
        "wall_s": round(wall, 3),
        "server_cpu_s": round(cpu, 3),
        "server_cpu_us_per_event": round(cpu / n * 1e6, 2),
        "event_delay_ms": _delay_ms(result["delays"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=CANDIDATES, help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--events", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="*", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.step_ms, args.events)
        return
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for kind in args.only:
            run = measure(kind, args.streams, args.events, args.step_ms)
            runs.setdefault(kind, []).append(run)
            print(
                f"{kind:9s} {run['server_cpu_us_per_event']:7.2f} us/event  "
                f"delay p99 {run['event_delay_ms']['p99']:6.2f} ms  "
                f"events {run['events']}/{run['expected']}",
                flush=True,
            )
    best = {kind: min(r["server_cpu_us_per_event"] for r in rs) for kind, rs in runs.items()}
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    out = {
        "command": " ".join(["python", "benchmarks/http_library.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "versions": {
            name: installed(name) for name in ("aiohttp", "uvicorn", "httptools", "grpcio")
        },
        "workload": {"streams": args.streams, "events": args.events, "step_ms": args.step_ms},
        "server_cpu_us_per_event_best": best,
        "runs": runs,
    }
    print(json.dumps(best))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
