"""One cadence.v1 `Generate` handler served three ways, for benchmarks/native_grpc.py:

- `grpc-aio`: grpc.aio, as cadence's front serves gRPC today;
- `pyvoy-thin`: pyvoy (Envoy's HTTP/2 with the Python app in a dynamic module, ASGI with the
  trailers extension) running `thin_app`, a gRPC framing of about a hundred lines here;
- `pyvoy-thin-watch`: `thin_app` with a watcher that asks pyvoy every 20 ms, until the stream's
  first message, whether the client went away (see `_watch`);
- `pyvoy-connect`: pyvoy running `connect_app`, connect-python's ASGI application, which
  speaks the gRPC protocol (and Connect and gRPC-Web) from hand-made endpoints (no codegen).

The handler is `stream_chunks`: like sse_reference.py, one timer wakes every open stream at one
instant per `--step-ms` (as cadence's workers deliver a step's tokens) and each stream sends one
token per step, with cadence's timing fields when the request asks for them, so the lab's load
generator reads it as it reads cadence.

Planted behaviours for the wire checks (benchmarks/native_grpc_wire.py), chosen by the request
id: `abort:...` ends the stream after its `max_tokens` chunks with INVALID_ARGUMENT and a
message that needs percent-encoding; `idle:...` waits IDLE_S before its first chunk, as a
request in a queue or a long prefill does. With NATIVE_GRPC_EVENTS=FILE every stream appends a line
to FILE when it starts (with the deadline the server read) and when it ends (how), so a check
can see from the outside what the server saw.

    python benchmarks/native_grpc_server.py --kind pyvoy-thin --port 0 --step-ms 20

Prints `cadence serving on HOST:PORT` (the banner cadence's ServerProcess reads) once serving.
For the pyvoy kinds this process only starts Envoy (its child, which imports this module to run
the app) and waits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sse_reference import Ticker  # one timer that wakes every stream per step

from cadence.net.asgi_grpc import parse_timeout, percent_encode
from cadence.proto.v1 import inference_pb2 as pb

KINDS = ("grpc-aio", "pyvoy-thin", "pyvoy-thin-watch", "pyvoy-connect")
SERVICE, METHOD = "cadence.v1.Inference", "Generate"
PATH = f"/{SERVICE}/{METHOD}"
STEP_ENV, EVENTS_ENV = "NATIVE_GRPC_STEP_MS", "NATIVE_GRPC_EVENTS"

OK, CANCELLED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL = 0, 1, 3, 4, 12, 13
PLANTED_MESSAGE = "planted error: 50% done, naïve"
"""Has a '%' and a non-ASCII letter: grpc-message must be percent-encoded on the wire."""
IDLE_S = 1.0
WATCH_S = 0.02
"""How often `pyvoy-thin-watch` asks whether a stream that has sent nothing yet was reset."""


class PlantedError(Exception):
    """The handler ends its stream with this status code and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def event(*words: object) -> None:
    """One line in the wire checks' event file; nothing when it is not set (the benchmark)."""
    path = os.environ.get(EVENTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(" ".join(str(w) for w in (f"{time.monotonic():.4f}", *words)) + "\n")


_ticker: Ticker | None = None


def ticker() -> Ticker:
    """The process's one step timer; made on first use, on the loop that serves (pyvoy's loop
    is not running when Envoy imports this module)."""
    global _ticker
    if _ticker is None:
        _ticker = Ticker(float(os.environ.get(STEP_ENV, "20")) / 1e3)
    return _ticker


async def stream_chunks(
    request: pb.GenerateRequest, deadline: float | None = None
) -> AsyncIterator[pb.GenerateChunk]:
    """The handler: `max_tokens` chunks of one token, one per step.

    `deadline` (loop time) is for servers that leave enforcing `grpc-timeout` to the handler;
    grpc.aio's core enforces it itself.
    """
    step = ticker()
    step_ns = int(step._step_s * 1e9)
    loop = asyncio.get_running_loop()
    received_ns, scheduled_ns = time.monotonic_ns(), 0
    last = request.max_tokens - 1
    if request.request_id.startswith("idle:"):
        await asyncio.sleep(IDLE_S)
    for i in range(request.max_tokens):
        if deadline is None:
            tick = await step.wait()
        else:
            # Only for calls that carry a deadline: the benchmark's carry none.
            try:
                tick = await asyncio.wait_for(step.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise PlantedError(DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        chunk = pb.GenerateChunk(
            request_id=request.request_id,
            index=i,
            token_ids=[65],
            text="A",
            finish_reason=pb.FINISH_REASON_LENGTH if i == last else 0,
        )
        if request.include_timing:
            scheduled_ns = scheduled_ns or tick - step_ns
            t = chunk.timing
            t.received_ns, t.scheduled_ns = received_ns, scheduled_ns
            t.step_start_ns, t.step_end_ns, t.front_recv_ns = tick - step_ns, tick, tick
            t.send_ns = time.monotonic_ns()
        yield chunk
    if request.request_id.startswith("abort:"):
        raise PlantedError(INVALID_ARGUMENT, PLANTED_MESSAGE)


async def read_body(receive) -> bytes | None:
    """An ASGI request's whole body, or None when the client went away first."""
    body = b""
    while True:
        got = await receive()
        if got["type"] == "http.disconnect":
            return None
        body += got.get("body", b"")
        if not got.get("more_body"):
            return body


# --- grpc.aio ---------------------------------------------------------------------------------


async def serve_grpc_aio(port: int) -> None:
    import grpc

    from cadence.proto.v1 import inference_pb2_grpc as pb_grpc

    class Inference(pb_grpc.InferenceServicer):
        async def Generate(self, request, context):
            remaining = context.time_remaining()
            event(
                "start",
                request.request_id,
                "timeout_s",
                "none" if remaining is None else f"{remaining:.3f}",
            )
            try:
                async for chunk in stream_chunks(request):
                    yield chunk
            except PlantedError as e:
                event("end", request.request_id, "status", e.code)
                await context.abort(_GRPC_CODES[e.code], e.message)
            except (asyncio.CancelledError, GeneratorExit):
                # grpc.aio cancels (or closes, when it was waiting on a write) the handler both
                # on the client's RST_STREAM and on the deadline; the event's time says which.
                event("end", request.request_id, "cancelled")
                raise
            event("end", request.request_id, "status", OK)

    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(Inference(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    _banner(bound)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def _grpc_codes() -> dict:
    import grpc

    return {code.value[0]: code for code in grpc.StatusCode}


_GRPC_CODES: dict = {}


# --- thin gRPC framing over ASGI (pyvoy) -----------------------------------------------------


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


_HEADERS = [(b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"identity")]
_MORE = {"type": "http.response.body", "body": b"", "more_body": True}


async def thin_app(scope, receive, send, watch: bool = False) -> None:
    """gRPC server streaming for `Generate` over ASGI with HTTP/2 trailers.

    What it takes from the protocol: a POST of one length-prefixed, uncompressed request
    message; `grpc-timeout` enforced here (the server side of a deadline); a reset stream
    ends the handler at its next message (see `_run_stream`); the status always in trailers
    after a 200 with `content-type: application/grpc` (never trailers-only, so that an HTTP
    server which cannot end a stream on its headers still answers correctly).
    """
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    if scope["type"] != "http":
        return None
    await send(
        {"type": "http.response.start", "status": 200, "headers": _HEADERS, "trailers": True}
    )
    status, message = OK, ""
    try:
        if scope["path"] != PATH or scope["method"] != "POST":
            raise PlantedError(UNIMPLEMENTED, f"unknown method {scope['path']}")
        timeout_s = None
        for name, value in scope["headers"]:
            if name == b"grpc-timeout":
                timeout_s = parse_timeout(value.decode())
            elif name == b"grpc-encoding" and value != b"identity":
                raise PlantedError(UNIMPLEMENTED, f"grpc-encoding {value.decode()}")
        body = await read_body(receive)
        if body is None:
            return None
        if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            raise PlantedError(INTERNAL, "expected one uncompressed request message")
        request = pb.GenerateRequest.FromString(body[5:])
        event(
            "start",
            request.request_id,
            "timeout_s",
            "none" if timeout_s is None else f"{timeout_s:.3f}",
        )
        if not watch:
            status, message = await _run_stream(request, timeout_s, send)
        else:
            sent = asyncio.Event()

            async def send_noting(message: dict) -> None:
                sent.set()
                await send(message)

            run = asyncio.ensure_future(_run_stream(request, timeout_s, send_noting))
            watcher = asyncio.ensure_future(_watch(receive, sent, run))
            try:
                status, message = await run
            except asyncio.CancelledError:
                event("end", request.request_id, "cancelled", "watcher")
                return None
            finally:
                watcher.cancel()
    except PlantedError as e:
        status, message = e.code, e.message
    except Exception as e:
        status, message = INTERNAL, f"{type(e).__name__}: {e}"
    if status is None:
        return None  # the client reset the stream: nobody to send a status to
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    trailers = [(b"grpc-status", b"%d" % status)]
    if message:
        trailers.append((b"grpc-message", percent_encode(message)))
    await send({"type": "http.response.trailers", "headers": trailers, "more_trailers": False})
    return None


async def _watch(receive, sent: asyncio.Event, run: asyncio.Future) -> None:
    """Cancel `run` when the client goes away before the stream's first message.

    pyvoy (1.3) answers `receive()` after the request body at once with an empty
    `http.request` until the client resets or closes, then with `http.disconnect`; awaiting it
    back to back would spin, so it is asked every WATCH_S. Once a message has gone out, the
    next send() fails on a reset, as every stream sends once per step.
    """
    while not sent.is_set():
        if (await receive())["type"] == "http.disconnect":
            run.cancel()
            return
        await asyncio.sleep(WATCH_S)


async def thin_watch_app(scope, receive, send) -> None:
    """`thin_app` with `_watch`."""
    return await thin_app(scope, receive, send, watch=True)


async def _run_stream(request, timeout_s, send) -> tuple[int | None, str]:
    """Send the stream's chunks; (status, message) at its end, status None when reset.

    A reset stream shows as the next send() failing (`ClientDisconnectedError`); before its
    first message only `_watch` notices one.
    """
    rid = request.request_id
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in stream_chunks(request):
                data = chunk.SerializeToString()
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"\0" + len(data).to_bytes(4, "big") + data,
                        "more_body": True,
                    }
                )
    except PlantedError as e:
        event("end", rid, "status", e.code)
        return e.code, e.message
    except TimeoutError:
        event("end", rid, "deadline")
        return DEADLINE_EXCEEDED, "Deadline Exceeded"
    except Exception as e:
        if type(e).__name__ != "ClientDisconnectedError":
            raise
        event("end", rid, "cancelled", type(e).__name__)
        return None, ""
    event("end", rid, "status", OK)
    return OK, ""


# --- connect-python's gRPC protocol over ASGI (pyvoy) ----------------------------------------


def _make_connect_app():
    from connectrpc.errors import ConnectError
    from connectrpc.method import IdempotencyLevel, MethodInfo
    from connectrpc.server import ConnectASGIApplication, Endpoint

    method = MethodInfo(
        name=METHOD,
        service_name=SERVICE,
        input=pb.GenerateRequest,
        output=pb.GenerateChunk,
        idempotency_level=IdempotencyLevel.UNKNOWN,
    )

    async def generate(request, ctx) -> AsyncIterator[pb.GenerateChunk]:
        remaining_ms = ctx.timeout_ms()
        event(
            "start",
            request.request_id,
            "timeout_s",
            "none" if remaining_ms is None else f"{remaining_ms / 1e3:.3f}",
        )
        # connect-python reads grpc-timeout but leaves enforcing it to the handler.
        deadline = (
            None if remaining_ms is None else asyncio.get_running_loop().time() + remaining_ms / 1e3
        )
        try:
            async for chunk in stream_chunks(request, deadline):
                yield chunk
        except PlantedError as e:
            event(
                "end",
                request.request_id,
                "deadline" if e.code == DEADLINE_EXCEEDED else "status",
                e.code,
            )
            raise ConnectError(_connect_code(e.code), e.message) from None
        except (asyncio.CancelledError, GeneratorExit):
            event("end", request.request_id, "cancelled")
            raise
        event("end", request.request_id, "status", OK)

    class App(ConnectASGIApplication):
        @property
        def path(self) -> str:
            return f"/{SERVICE}"

    return App(
        service=object(),
        endpoints=lambda _service: {PATH: Endpoint.server_stream(method, generate)},
        compressions=(),
    )


def _connect_code(grpc_code: int):
    from connectrpc.code import Code

    names = {
        OK: None,
        CANCELLED: "CANCELED",
        INVALID_ARGUMENT: "INVALID_ARGUMENT",
        DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
        UNIMPLEMENTED: "UNIMPLEMENTED",
        INTERNAL: "INTERNAL",
    }
    return getattr(Code, names[grpc_code])


class _LazyConnectApp:
    """connect-python is imported in Envoy's process only, when pyvoy-connect serves."""

    _app = None

    async def __call__(self, scope, receive, send):
        if self._app is None:
            type(self)._app = _make_connect_app()

        body_done = False

        async def receive_until_body_end():
            # connect-python watches receive() for http.disconnect during a server stream;
            # pyvoy answers every receive() after the body at once (see `_watch`), so that
            # watcher would spin. Past the body this waits instead, and a reset shows as a
            # failed send, as for thin_app.
            nonlocal body_done
            if body_done:
                await asyncio.get_running_loop().create_future()
            message = await receive()
            body_done = message["type"] == "http.request" and not message.get("more_body")
            return message

        return await self._app(scope, receive_until_body_end, send)


connect_app = _LazyConnectApp()


# --- process ----------------------------------------------------------------------------------


def _banner(port: int) -> None:
    print(f"cadence serving on 127.0.0.1:{port}", flush=True)


async def serve_pyvoy(app: str, port: int) -> None:
    from pyvoy import PyvoyServer

    # Envoy imports this module by name: this file's folder is on the PYTHONPATH pyvoy passes.
    server = PyvoyServer(
        app, address="127.0.0.1", port=port, lifespan=False, stderr=None, log_level="warning"
    )
    await server.start()
    _banner(server.listener_port)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.wait())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait((waiter, stopper), return_when=asyncio.FIRST_COMPLETED)
    await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    os.environ[STEP_ENV] = str(args.step_ms)  # Envoy's process reads it from its environment
    from cadence import event_loop

    if args.kind == "grpc-aio":
        _GRPC_CODES.update(_grpc_codes())
        event_loop.run(serve_grpc_aio(args.port))
    else:
        app = {
            "pyvoy-thin": "native_grpc_server:thin_app",
            "pyvoy-thin-watch": "native_grpc_server:thin_watch_app",
            "pyvoy-connect": "native_grpc_server:connect_app",
        }[args.kind]
        event_loop.run(serve_pyvoy(app, args.port))


if __name__ == "__main__":
    main()
