"""Admission control: how many streams the server serves at once."""

from __future__ import annotations


class AdmissionGate:
    """At most `limit` streams at once; a request beyond that is refused at once.

    Refusing at once (RESOURCE_EXHAUSTED) rather than queueing keeps every wait bounded:
    a client that is refused knows immediately and can retry or go elsewhere, and time to
    first token never hides an unbounded queue.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {limit}")
        self.limit = limit
        self.active = 0

    def try_enter(self) -> bool:
        """Take a slot if one is free."""
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        """Give a slot back; the next request can take it at once."""
        self.active -= 1
