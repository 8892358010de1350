"""The one error map: every `Failure` to its gRPC status (cadence.v1, and any call status)
and to the Open Inference Protocol's in-band error. docs/architecture.md's table of failures
is this map; tests/unit/test_error_map.py holds the two together.
"""

from __future__ import annotations

import grpc

from cadence.transport.messages import Failure

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


def kserve_error_message(failure: Failure, message: str) -> str:
    """The `error_message` of a `ModelStreamInferResponse` that reports one request's failure
    in-band (the call goes on): the gRPC status code's name, then the message."""
    return f"{GRPC_STATUS[failure].name}: {message}"
