"""Prototype: cadence's own front (its core, its workers, the cadence.v1 adapter
`InferenceService.Generate` unchanged) with cadence.v1 served by pyvoy (Envoy's HTTP/2) through
the thin gRPC framing of benchmarks/native_grpc_server.py, to measure the front's CPU per
chunk on that path beside `cadence serve`'s grpc.aio.

    python benchmarks/native_grpc_front.py --port 0 --devices cpu:2 --step-ms 20 ...

takes `cadence serve`'s arguments and prints the same banner once Envoy listens. Envoy loads
`front_app`, whose ASGI lifespan starts a `CadenceServer` (its workers, the core, and, unused
here, its grpc.aio port) on pyvoy's event loop; `/cadence.v1.Inference/Generate` on Envoy's
port goes to the same `InferenceService` the grpc.aio server would call, through `AsgiContext`,
which stands in for what it uses of grpc.aio's ServicerContext.

Not a server for use: no health, reflection, KServe, auth, TLS, drain or `--fronts`, and a
reset stream ends its handler at its next chunk (see native_grpc_server.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from native_grpc_server import parse_timeout, percent_encode, read_body

ARGS_ENV, PYTHON_ENV = "NATIVE_FRONT_ARGS", "NATIVE_FRONT_PYTHON"
PATH = "/cadence.v1.Inference/Generate"
_HEADERS = [(b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"identity")]


class _Abort(Exception):
    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class AsgiContext:
    """What `InferenceService.Generate` asks of grpc.aio's ServicerContext, over ASGI."""

    def __init__(self, timeout_s: float | None, headers=()) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._metadata = tuple((k.decode(), v.decode()) for k, v in headers
                               if not k.startswith(b":"))
        self._deadline = None if timeout_s is None else loop.time() + timeout_s
        self.initial: tuple = ()
        self.trailing: tuple = ()
        self.code, self.details = 0, ""

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Abort(code.value[0], details)

    async def send_initial_metadata(self, metadata) -> None:
        # pyvoy sends the response's headers with its first body chunk whatever the app does,
        # so they are kept until then.
        self.initial = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code.value[0]

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)


def _pairs(metadata) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode() if isinstance(v, str) else v) for k, v in metadata]


class FrontApp:
    """The ASGI app Envoy runs: the front's lifespan and its cadence.v1 Generate."""

    def __init__(self) -> None:
        self._server = None
        self._v1 = None

    async def _lifespan(self, receive, send) -> None:
        from cadence.api.v1.service import InferenceService
        from cadence.cli import _server_config, build_parser
        from cadence.lifecycle.server import CadenceServer

        await receive()  # lifespan.startup
        # Inside Envoy sys.executable is not Python; workers start with the one that started
        # Envoy, without the libpython pyvoy preloads into Envoy.
        sys.executable = os.environ[PYTHON_ENV]
        os.environ.pop("LD_PRELOAD", None)
        args = build_parser().parse_args(["serve", *json.loads(os.environ[ARGS_ENV])])
        server = CadenceServer(_server_config(args))
        try:
            await server.start()
        except Exception as exc:  # noqa: BLE001 (Envoy's log shows why the front did not start)
            await send({"type": "lifespan.startup.failed", "message": repr(exc)})
            return
        self._server = server
        self._v1 = InferenceService(server.core, server.layout.metadata())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await server.stop()
        await send({"type": "lifespan.shutdown.complete"})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return None
        if self._v1 is None or scope["path"] != PATH:
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS,
                        "trailers": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            await send({"type": "http.response.trailers", "more_trailers": False, "headers": [
                (b"grpc-status", b"14" if self._v1 is None else b"12")]})
            return None
        timeout_s = None
        for name, value in scope["headers"]:
            if name == b"grpc-timeout":
                timeout_s = parse_timeout(value.decode())
        body = await read_body(receive)
        if body is None:
            return None
        context = AsgiContext(timeout_s, scope["headers"])
        started = False

        async def start() -> None:
            nonlocal started
            started = True
            await send({"type": "http.response.start", "status": 200, "trailers": True,
                        "headers": [*_HEADERS, *_pairs(context.initial)]})

        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in self._v1.Generate(body[5:], context):
                    if not started:
                        await start()
                    data = chunk.SerializeToString()
                    await send({"type": "http.response.body",
                                "body": b"\0" + len(data).to_bytes(4, "big") + data,
                                "more_body": True})
        except _Abort as e:
            context.code, context.details = e.code, e.details
        except TimeoutError:
            context.code, context.details = 4, "Deadline Exceeded"
        except Exception as e:  # noqa: BLE001 (a failure is the call's status, as in grpc.aio)
            if type(e).__name__ == "ClientDisconnectedError":
                return None  # the client reset the stream
            context.code, context.details = 13, f"{type(e).__name__}: {e}"
        if not started:
            await start()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        trailers = [(b"grpc-status", b"%d" % context.code), *_pairs(context.trailing)]
        if context.details:
            trailers.append((b"grpc-message", percent_encode(context.details)))
        await send({"type": "http.response.trailers", "headers": trailers,
                    "more_trailers": False})
        return None


front_app = FrontApp()


async def _main(args: list[str]) -> None:
    from pyvoy import PyvoyServer

    port = 0
    if "--port" in args:
        i = args.index("--port")
        port = int(args[i + 1])
        args = args[:i] + args[i + 2:]
    os.environ[ARGS_ENV] = json.dumps(["--port", "0", *args])
    os.environ[PYTHON_ENV] = sys.executable
    server = PyvoyServer("native_grpc_front:front_app", address="127.0.0.1", port=port,
                         lifespan=True, stderr=None, log_level="warning")
    await server.start()
    print(f"cadence serving on 127.0.0.1:{server.listener_port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.wait())
    await asyncio.wait((waiter, asyncio.ensure_future(stop.wait())),
                       return_when=asyncio.FIRST_COMPLETED)
    await server.stop()


if __name__ == "__main__":
    from cadence import event_loop

    event_loop.run(_main(sys.argv[1:]))
