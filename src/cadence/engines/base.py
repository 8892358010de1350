"""What the worker's batching loop needs from an engine, and the sequence it steps.

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


class Engine(Protocol):
    """A model that steps a batch of sequences; it never sees sockets or clocks of the server.

    Optional, looked up by the batching loop when present:
    - `reserve(seq) -> bool`: claim what the sequence needs (KV cache) just before it is
      admitted; False keeps it waiting until running sequences release theirs. An engine
      with a prefix cache sets `seq.prefilled` to the leading tokens of `seq.prefill_ids`
      it holds already (a whole block's worth each, never the last token).
    - `preempt(seq) -> list[int]`: drop what a running (or part-prefilled) sequence holds
      so that another can run; return the tokens to prefill when it is admitted again (its
      prompt and its outputs so far), from which it goes on as if never stopped.
    - `tokenizer`: an object with `encode(text) -> list[int]` and `stream(prompt_ids) ->
      Callable[[int, bool], str]`; when not None the worker tokenizes text prompts and sends each
      token's text piece (a model with its own vocabulary). Absent or None: byte tokens.
      Without `decode(ids) -> str` too, a prompt sent as token ids has no text: user models
      and apps refuse it (cadence.engines.detokenizer.prompt_decoder).
    - `text_piece_ids(text) -> list[int]`: an engine whose step may also return a `str` (a
      piece of text) or None (the sequence is done) for a sequence, instead of a token id,
      gives a piece's token ids with it; it needs a `tokenizer` too. StepFailed from it
      fails that one sequence. Such an engine's tokenizer is the user's: whatever its
      `encode`, `stream` (and the decoders it returns) raise, and text they give that
      cadence.engines.output_text finds fault with, fails that request alone.
    - `tokenizer_name`: how messages name the tokenizer (e.g. `MyModel.tokenizer`).
    - `step_errors`: a list that `step` fills with (sequence, Failure, message) for each
      sequence of the step that failed alone (a user's model gave a `SequenceError`, another
      exception or a bad output in its place); the batching loop ends those sequences with
      their failure, ignores their outputs, and empties the list.
    - `max_batch`: sequences per step at most, when below the server's --max-batch.
    - `takes_prefill_chunks`: True when `step` can prefill part of a prompt: a sequence in
      `prefill` then stands for its chunk `prompt_token_ids[seq.prefilled:seq.prefill_to]`,
      to append to what the engine holds for it; its output is ignored (no token) until the
      chunk that ends the prompt. Only with a step budget (cadence.worker.step_budget).
    - `kv_cache_usage() -> float`: the share of its KV cache that sequences hold after a
      step, 0 to 1 (exported as `vllm:kv_cache_usage_perc`); absent: 0, no cache to fill.
    - `close()`: called once when the worker stops (tensor-parallel groups stop their ranks).
    """

    name: str
    vocab_size: int

    def start(self) -> None:
        """Load weights and warm up; the worker reports ready after this returns."""

    def check(self, request: AddRequest) -> str | None:
        """Return why `request` cannot run on this engine (a message for the user), or None."""

    def step(self, prefill: list[Sequence], decode: list[Sequence]) -> StepResult:
        """Run one step: prefill the new sequences, decode the others; one new token each
        (or, with `text_piece_ids`, a text piece or None).

        Returns the tokens in the order `prefill + decode`. Raises StepFailed when only this
        step's sequences are lost.
        """

    def release(self, seq: Sequence) -> None:
        """Free what the engine holds for a sequence that finished or was aborted."""


@runtime_checkable
class Follower(Protocol):
    """An engine that runs tensor-parallel (`--tp`): on ranks above 0 it steps as its rank 0
    broadcasts, instead of talking to a front."""

    def follow(self) -> None:
        """Step as rank 0 does until it stops; then close."""
