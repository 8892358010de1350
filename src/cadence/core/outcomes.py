"""How a request ends: `Finish` when it completed, `Failure` when it did not. The core's own
vocabulary, shared by every protocol adapter (cadence.api.errors maps it to theirs) and by the
workers, whose messages carry it (cadence.transport.messages)."""

from __future__ import annotations

import enum


class Finish(enum.IntEnum):
    """Why a sequence ended; the values are those of the proto's FinishReason."""

    NONE = 0
    LENGTH = 1
    STOP = 2
    CANCELLED = 3


class Failure(enum.IntEnum):
    """Why a request ended without finishing: the one error vocabulary of cadence, from the
    worker that detects a failure to the front that reports it. The names (and numbers) are
    gRPC's status codes; cadence.api.errors maps each to every protocol's own form."""

    CANCELLED = 1
    """The client went away (or a drain ended the request)."""
    INVALID_ARGUMENT = 3
    """The request cannot be served as sent; the message says what to change."""
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    """The request names a model (or version) this server does not serve."""
    RESOURCE_EXHAUSTED = 8
    """A limit: --max-concurrent, --overflow abort, --stall-timeout, message size."""
    INTERNAL = 13
    """The app's function raised, or yielded something that is not output."""
    UNAVAILABLE = 14
    """Not now, retry: starting, draining, its worker stopped, no worker."""
