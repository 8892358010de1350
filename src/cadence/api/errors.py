"""The one error map: every `Failure` to its gRPC status (cadence.v1, and any call status),
to the Open Inference Protocol's in-band error, and to the OpenAI-compatible HTTP API's
status and error body. docs/architecture.md's table of failures
is this map; tests/unit/api/test_error_map.py holds the two together.
"""

from __future__ import annotations

import contextlib

import grpc

from cadence.vocabulary import Failure

GRPC_STATUS: dict[Failure, grpc.StatusCode] = {
    Failure.CANCELLED: grpc.StatusCode.CANCELLED,
    Failure.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Failure.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
"""The gRPC status of each failure: a cadence.v1 call's status, and a KServe call's when the
failure ends the whole call."""


def grpc_status(failure: Failure) -> grpc.StatusCode:
    return GRPC_STATUS[failure]


async def end_cancelled_call(
    context: grpc.aio.ServicerContext, failure: Failure, message: str
) -> None:
    """End with `failure`'s status a grpc.aio call whose handler was cancelled (a stalled
    client cut off: `RequestStream.end_call`). grpc.aio ends such a call with no status, so a
    client that reads again would wait for its deadline; now it gets what was sent, then this."""
    with contextlib.suppress(grpc.aio.AbortError, grpc.aio.UsageError):
        await context.abort(grpc_status(failure), message)


def kserve_error_message(failure: Failure, message: str) -> str:
    """The `error_message` of a `ModelStreamInferResponse` that reports one request's failure
    in-band (the call goes on): the gRPC status code's name, then the message."""
    return f"{GRPC_STATUS[failure].name}: {message}"


HTTP_STATUS: dict[Failure, tuple[int, str]] = {
    Failure.CANCELLED: (499, "cancelled"),
    Failure.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Failure.DEADLINE_EXCEEDED: (504, "timeout_error"),
    Failure.NOT_FOUND: (404, "not_found_error"),
    Failure.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Failure.INTERNAL: (500, "server_error"),
    Failure.UNAVAILABLE: (503, "service_unavailable_error"),
}
"""The OpenAI-compatible HTTP API's status and error `type` of each failure (499, nginx's
"client closed request", only counts: the client is gone). The adapter builds the body
(cadence.api.openai.protocol.error_body), with the failure's name in lower case as `code`."""
HTTP_UNAUTHENTICATED = (401, "authentication_error")
"""No valid bearer token (`--auth-token-file`), decided before any handler."""
HTTP_REQUEST_TIMEOUT = (408, "timeout_error")
"""The client did not send its request's body within `--http-body-timeout`."""
HTTP_PAYLOAD_TOO_LARGE = (413, "invalid_request_error")
"""A request body over `--max-message-bytes` (nginx and Envoy answer 413 too); decided from
its Content-Length before any of it is read, else when the body reaches the limit."""


def http_status(failure: Failure) -> tuple[int, str]:
    """The HTTP status and OpenAI error `type` of a failure."""
    return HTTP_STATUS[failure]
