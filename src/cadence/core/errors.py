"""The core's failures as exceptions: a request that cannot start, or a stream that ended
without finishing. Each carries a `Failure` (cadence.vocabulary: the one error
vocabulary, also what a worker reports) and a message that says what to do; the protocol
adapters turn them into their own form with cadence.api.errors, in one place.
"""

from __future__ import annotations

from cadence.vocabulary import Failure


class RequestError(Exception):
    """A request failed: `failure` says how, `message` why and what to do."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message


class InvalidRequest(RequestError):
    """The request cannot be served as sent; the message says what to change."""

    def __init__(self, message: str) -> None:
        super().__init__(Failure.INVALID_ARGUMENT, message)
