"""The sequence a worker's engine steps, and how a step or a sequence fails
(cadence.engines.engine.Engine is what the batching loop steps).

`Sequence` is public (`cadence.Sequence`): a user's batched model (`--engine MODULE:CLASS`,
see cadence.engines.user_model and docs/models.md) is handed the same objects as the
built-in engines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from cadence.vocabulary import AddRequest, Sampling


class Sequence:
    """One request inside a worker: its prompt, limits, sampling parameters and how far it
    has got. A model reads it and keeps its own per-sequence data in `state`."""

    __slots__ = (
        "seq_id",
        "request",
        "stop_token_ids",
        "generated",
        "state",
        "detokenize",
        "prompt",
        "prefilled",
        "prefill_to",
        "prefill_ids",
        "cached_tokens",
        "arrival",
    )

    def __init__(self, request: AddRequest) -> None:
        self.seq_id = request.seq_id
        """The server's number for this request (unique within a server run)."""
        self.request = request
        """The worker's message that started the sequence (every field below comes from it)."""
        self.stop_token_ids = frozenset(request.sampling.stop_token_ids)
        """Token ids that end the sequence (finish STOP) once the model outputs one: the
        request's (`sampling.stop_token_ids`), and those an engine adds (its model's EOS)."""
        self.generated = 0
        """Outputs given so far: 0 while the sequence is in `prefill`."""
        self.prefill_ids = request.prompt_token_ids
        """The tokens to prefill: the prompt; after the sequence was preempted (its KV
        dropped, `Engine.preempt`), the prompt and every output given so far."""
        self.prefilled = 0
        """Prompt tokens the model processed in earlier steps (all of them once decoding),
        or that its prefix cache held when the sequence was admitted (`reserve`)."""
        self.prefill_to = len(request.prompt_token_ids)
        """Prompt tokens processed once this step's prefill is done: a step's `prefill` asks
        the model for `prefill_ids[prefilled:prefill_to]`. The whole prompt (0 to its
        length) in one step unless the engine takes prefill chunks (`takes_prefill_chunks`)
        and the server has a step budget (--max-step-tokens, --itl-target-ms)."""
        self.cached_tokens = 0
        """Prompt tokens the engine's prefix cache held when the sequence was first admitted."""
        self.state: object = None
        """The engine's (the model's) own per-sequence data: a text offset, a KV-cache slot, ..."""
        self.detokenize: Callable[[int, bool], str] | None = None
        """For engines with their own tokenizer: turns each new token (and whether it is the
        sequence's last) into its text piece."""
        self.prompt = request.prompt_text
        """The prompt as text: the client's text; for a client that sent token ids, a user's
        model sees their decoding (by its tokenizer, or as UTF-8 bytes)."""
        self.arrival = 0
        """Its place in the worker's arrival order (the scheduler's: who goes first among
        equal priorities, kept across a preemption)."""

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt as token ids (the model's tokenizer's when it has one, else bytes)."""
        return self.request.prompt_token_ids

    @property
    def max_tokens(self) -> int:
        """Outputs at most; the sequence finishes with LENGTH at this many."""
        return self.request.max_tokens

    @property
    def sampling(self) -> Sampling:
        """The request's generation parameters (temperature, top_p, top_k, seed, stop token
        ids), as the client sent them."""
        return self.request.sampling

    # The sampling parameters one by one, as user models have read them: `sampling`'s.

    @property
    def temperature(self) -> float:
        """Sampling temperature; 0 asks for greedy decoding (`sampling.temperature`)."""
        return self.request.sampling.temperature

    @property
    def top_p(self) -> float:
        """`sampling.top_p`."""
        return self.request.sampling.top_p

    @property
    def top_k(self) -> int:
        """`sampling.top_k`."""
        return self.request.sampling.top_k

    @property
    def seed(self) -> int:
        """`sampling.seed`."""
        return self.request.sampling.seed

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, prompt={self.prompt!r}, "
            f"generated={self.generated}, max_tokens={self.max_tokens})"
        )


class StepFailed(Exception):
    """An engine's step failed, and the engine can go on: the step's sequences end with
    INTERNAL and this message; the worker keeps serving the others."""


class SequenceError(Exception):
    """One sequence's failure, put in its place among a step's outputs (`cadence.SequenceError`,
    docs/models.md): that sequence alone ends with `status` and this message, as it is; the
    step's other sequences get their outputs and go on (as a Triton Python backend's
    `execute` gives each request its own response, error or not). Any other exception in a
    sequence's place does the same with INTERNAL, its message naming the model and the
    exception. An exception raised out of `step` still fails the whole step."""

    STATUSES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE")
    """The statuses a model may end a sequence with (gRPC's names; cadence.api.errors gives
    each protocol's form): the request cannot be served as sent, a limit (memory, cache), the
    model's fault, or not now (the client may retry)."""

    def __init__(self, message: str, status: str = "INTERNAL") -> None:
        if status not in self.STATUSES:
            raise ValueError(
                f"SequenceError status must be one of {', '.join(self.STATUSES)}; got {status!r}"
            )
        super().__init__(message)
        self.message = message
        self.status = status


class EngineLoadError(Exception):
    """The engine could not be built; the message says what to fix (one line)."""


StepResult = list[int] | list[int | str | None]
"""What `Engine.step` gives: one token id per sequence; an engine with `text_piece_ids` (a
user's model) may also give a text piece (`str`) or None (done) in a sequence's place."""


@runtime_checkable
class Follower(Protocol):
    """An engine that runs tensor-parallel (`--tp`): on ranks above 0 it steps as its rank 0
    broadcasts, instead of talking to a front."""

    def follow(self) -> None:
        """Step as rank 0 does until it stops; then close."""
