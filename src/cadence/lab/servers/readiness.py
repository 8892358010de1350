"""Does a gRPC server answer? For `cadence bench` (fail at once, in one line, when it does
not) and `cadence sweep --server-cmd` (wait until a server it started is ready).

A server answers when a `grpc.health.v1.Health/Check` call gets any reply but UNAVAILABLE:
SERVING is ready; UNIMPLEMENTED (no health service) counts as ready once the TCP port
accepts, since the call itself went through the server's gRPC stack; NOT_SERVING is not yet
ready. The call never waits for a connection (wait_for_ready off), so a closed port answers
in milliseconds instead of after the channel's back-off.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from cadence.credentials import ClientCredentials

_CHECK = "/grpc.health.v1.Health/Check"
_SERVING = 1


def probe(
    target: str, credentials: ClientCredentials | None = None, timeout: float = 2.0
) -> tuple[bool, str]:
    """(ready, what was seen) after one health check of `target`."""
    from grpc_health.v1 import health_pb2

    with (credentials or ClientCredentials()).channel(target) as channel:
        check = channel.unary_unary(
            _CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            reply = check(health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return True, "no health service; gRPC answers"
            if code == grpc.StatusCode.UNAVAILABLE:
                return False, (exc.details() or "unavailable").splitlines()[0]
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False, f"no answer within {timeout:g} s"
            return True, f"health check answered {code.name}"
    if reply.status == _SERVING:
        return True, "health SERVING"
    return False, f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"


def require_reachable(target: str, credentials: ClientCredentials | None = None) -> None:
    """Raise RuntimeError (one line) when nothing answers gRPC at `target`."""
    ready, seen = probe(target, credentials, timeout=5.0)
    if not ready and not seen.startswith("health "):
        raise RuntimeError(f"no gRPC server answers at {target}: {seen}")


def wait_ready(
    target: str,
    timeout: float,
    exited: Callable[[], int | None],
    credentials: ClientCredentials | None = None,
    poll_s: float = 0.1,
) -> str:
    """Poll until `target` is ready; return what was seen. RuntimeError when `exited()`
    returns an exit status (the server's process ended) or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    seen = "nothing yet"
    while True:
        status = exited()
        if status is not None:
            raise RuntimeError(f"the server exited with status {status} before it was ready")
        ready, seen = probe(target, credentials, timeout=min(2.0, max(0.1, timeout)))
        if ready:
            return seen
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the server was not ready within {timeout:g} s (last: {seen})")
        time.sleep(poll_s)
