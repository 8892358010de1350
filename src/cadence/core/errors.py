"""The core's failures as exceptions: a request that cannot start, or a stream that ended
without finishing. Each carries a `Failure` (cadence.vocabulary: the one error
vocabulary, also what a worker reports), a message that says what to do, and, when the
failure is about one field of the request, that field (`parameter`); the protocol adapters
turn them into their own form with cadence.api.errors, in one place each.
"""

from __future__ import annotations

from cadence.vocabulary import Failure


class RequestError(Exception):
    """A request failed: `failure` says how, `message` why and what to do, `parameter` which
    field of the request it is about (None: the request as a whole)."""

    def __init__(self, failure: Failure, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message
        self.parameter = parameter
        """The field, named as whoever raised the error reads it: the core as its `Request`'s
        field (`max_tokens`, `prompt`, `prompt_token_ids`, `sampling.temperature`, ...), an
        adapter as its own wire's field. An adapter maps the core's names to its wire's."""


class InvalidRequest(RequestError):
    """The request cannot be served as sent; the message says what to change, `parameter`
    names the field (as vLLM's `VLLMValidationError(parameter=...)` does)."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(Failure.INVALID_ARGUMENT, message, parameter)
