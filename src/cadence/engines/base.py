"""What the worker's batching loop needs from an engine."""

from __future__ import annotations

from typing import Protocol

from cadence.transport.messages import AddRequest


class Sequence:
    """A request inside a worker: its prompt, limits and how far it has got."""

    __slots__ = ("seq_id", "request", "stop_token_ids", "generated", "state")

    def __init__(self, request: AddRequest) -> None:
        self.seq_id = request.seq_id
        self.request = request
        self.stop_token_ids = frozenset(request.stop_token_ids)
        self.generated = 0
        self.state: object = None
        """Engine-owned per-sequence state (a text offset, a KV-cache slot, ...)."""


class Engine(Protocol):
    """A model that steps a batch of sequences; it never sees sockets or clocks of the server."""

    name: str
    vocab_size: int

    def start(self) -> None:
        """Load weights and warm up; the worker reports ready after this returns."""

    def check(self, request: AddRequest) -> str | None:
        """Return why `request` cannot run on this engine (a message for the user), or None."""

    def step(self, prefill: list[Sequence], decode: list[Sequence]) -> list[int]:
        """Run one step: prefill the new sequences, decode the others; one new token each.

        Returns the tokens in the order `prefill + decode`.
        """

    def release(self, seq: Sequence) -> None:
        """Free what the engine holds for a sequence that finished or was aborted."""
