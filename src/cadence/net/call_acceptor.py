"""Keeps several incoming calls requested from gRPC's core before they arrive.

grpc.aio asks its core for one incoming call per method at a time, and asks for the next only
once the event loop has handed the last one to its handler, two or three loop iterations
later. While hundreds of streams keep the front's loop busy, an iteration lasts milliseconds,
so new calls are taken in at a few dozen a second: a burst of new calls that arrives after
other streams have started waits seconds for its first token (measured by
benchmarks/accept_burst.py, figures in results/accept_burst.json). gRPC's core expects a server to keep many requests outstanding
(its C++ and C# servers ask for hundreds at start); grpc.aio has no option for it.

`CallAcceptor` asks for `depth` more calls per method, through the same private functions
grpc.aio's own accept loop uses, and hands each call to grpc.aio's handler path unchanged
(interceptors, cancellation, status). It checks those functions' signatures first: on a
grpcio whose internals differ it does nothing, and the server runs on grpc.aio's own loop; the
start-up log warns, and the metric cadence_accept_ahead_calls reads 0. pyproject.toml bounds
grpcio to the minor version this is tested on, so an upgrade is a deliberate step.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Mapping, Sequence

import grpc
from grpc._cython import cygrpc

log = logging.getLogger("cadence.front")

_SIGNATURES = {
    "_handle_rpc": (
        "method_name",
        "method_resolver",
        "interceptors",
        "rpc_state",
        "loop",
        "concurrency_exceeded",
    ),
    "_schedule_rpc_coro": ("rpc_coro", "rpc_state", "loop", "method_name"),
}


def supported(server: grpc.aio.Server) -> bool:
    """Whether this grpcio has the internals `CallAcceptor` relies on, as it expects them."""
    core = getattr(server, "_server", None)
    if core is None or not hasattr(cygrpc, "_MethodResolver"):
        return False
    functions = [(getattr(cygrpc, name, None), expected) for name, expected in _SIGNATURES.items()]
    functions.append((getattr(core, "_request_registered_call", None), ("method",)))
    for function, expected in functions:
        if function is None:  # missing
            return False
        try:
            if tuple(inspect.signature(function).parameters) != expected:
                return False
        except (TypeError, ValueError):  # missing, or no signature to read
            return False
    return hasattr(core, "is_running")


class CallAcceptor:
    """Requests `depth` incoming calls ahead, per registered method in `handlers`.

    `handlers` maps fully qualified method names ("/package.Service/Method") to the handlers
    registered with `add_registered_method_handlers` before the server started; `interceptors`
    are the server's, in its order.
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        handlers: Mapping[str, grpc.RpcMethodHandler],
        interceptors: Sequence[grpc.aio.ServerInterceptor],
        depth: int,
    ) -> None:
        self._server = server
        self._handlers = dict(handlers)
        self._interceptors = tuple(interceptors)
        self._depth = depth
        self._accepting: set[asyncio.Task] = set()
        self._calls: set[asyncio.Task] = set()
        self.accepted = 0
        """Calls taken in through the requests made here (the rest came through grpc.aio's)."""

    def start(self) -> bool:
        """Start requesting calls (after `server.start()`); False when it cannot here."""
        if self._depth <= 0 or not self._handlers:
            return False
        if not supported(self._server):
            # Said loudly (and in cadence_accept_ahead_calls = 0): under load, bursts of new
            # calls then wait seconds for grpc.aio's loop to take them in.
            log.warning(
                "--accept-ahead is off: grpcio %s's internals are not those the call "
                "acceptor was tested on (grpcio 1.85); new calls are taken in one at a "
                "time, so under load a burst of calls can wait for its first token. "
                "Install the grpcio version cadence requires.",
                grpc.__version__,
            )
            return False
        loop = asyncio.get_running_loop()
        resolver = cygrpc._MethodResolver([], self._handlers)
        for method in self._handlers:
            for _ in range(self._depth):
                task = loop.create_task(self._accept(method, resolver, loop))
                self._accepting.add(task)
                task.add_done_callback(self._accepting.discard)
        return True

    async def _accept(self, method: str, resolver: object, loop: asyncio.AbstractEventLoop) -> None:
        core = self._server._server
        method_bytes = method.encode()
        while core.is_running():
            try:
                rpc_state = await core._request_registered_call(method_bytes)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # At shutdown every outstanding request fails; while running, a failure
                # would repeat, so this request slot ends (grpc.aio's own loop goes on).
                if core.is_running():
                    log.warning("stopped requesting %s calls ahead: %r", method, exc)
                return
            self.accepted += 1
            rpc = cygrpc._handle_rpc(method, resolver, self._interceptors, rpc_state, loop, False)
            call = loop.create_task(cygrpc._schedule_rpc_coro(rpc, rpc_state, loop, method))
            self._calls.add(call)  # the loop keeps only a weak reference to a task
            call.add_done_callback(self._calls.discard)

    def close(self) -> None:
        """After the server stopped: end any request slot still waiting.

        Never before: a call the core matched to a cancelled request would be lost."""
        for task in list(self._accepting):
            task.cancel()
