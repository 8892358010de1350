"""What the worker's batching loop needs from an engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cadence.transport.messages import AddRequest


class Sequence:
    """A request inside a worker: its prompt, limits and how far it has got."""

    __slots__ = ("seq_id", "request", "stop_token_ids", "generated", "state", "detokenize")

    def __init__(self, request: AddRequest) -> None:
        self.seq_id = request.seq_id
        self.request = request
        self.stop_token_ids = frozenset(request.stop_token_ids)
        self.generated = 0
        self.state: object = None
        """Engine-owned per-sequence state (a text offset, a KV-cache slot, ...)."""
        self.detokenize: Callable[[int, bool], str] | None = None
        """For engines with their own tokenizer: turns each new token (and whether it is the
        sequence's last) into its text piece."""


class Engine(Protocol):
    """A model that steps a batch of sequences; it never sees sockets or clocks of the server.

    Optional, looked up by the batching loop when present:
    - `reserve(seq) -> bool`: claim what the sequence needs (KV cache) just before it is
      admitted; False keeps it waiting until running sequences release theirs.
    - `tokenizer`: an object with `encode(text) -> list[int]` and `stream(prompt_ids) ->
      Callable[[int, bool], str]`; when not None the worker tokenizes text prompts and sends each
      token's text piece (a model with its own vocabulary). Absent or None: byte tokens.
    - `close()`: called once when the worker stops (tensor-parallel groups stop their ranks).
    """

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
