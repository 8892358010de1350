"""What the worker's batching loop (cadence.worker.batch_scheduler) steps: `Engine`, a
`cadence.Model` with what only cadence's own engines give the loop besides.

The built-in engines (synthetic, torch) and `ModelEngine`, which serves a user's model class
(and `--engine transformers`, itself such a class), derive from it; the loop reads every
member directly, each optional one having its default here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from cadence.engines.base import Sequence, StepResult
from cadence.engines.model_api import Model, member
from cadence.vocabulary import Failure


class Engine(Model):
    """A model that steps a batch of sequences; it never sees sockets or clocks of the server.

    Required: `name`, `vocab_size` (0: not known; prompt ids are not checked against it) and
    `step`. Everything `cadence.Model` declares means the same here, with its default:
    `reserve(seq)` (True), `release(seq)`, `check(seq)` (None), `close()`, `max_batch`
    (None), `tokenizer` (None), `takes_prefill_chunks` (False); for an engine:

    - `reserve(seq) -> bool`: an engine with a prefix cache also sets `seq.prefilled` to the
      leading tokens of `seq.prefill_ids` it holds already (a whole block's worth each,
      never the last token).
    - `tokenizer`: an object with `encode(text) -> list[int]` and `stream(prompt_ids) ->
      Callable[[int, bool], str]` (a user model's is wrapped so: `ModelEngine`); when not
      None the worker tokenizes text prompts and sends each token's text piece. None: byte
      tokens. Without `decode(ids) -> str` too, a prompt sent as token ids has no text: user
      models and apps refuse it (cadence.engines.detokenizer.prompt_decoder).
    - `takes_prefill_chunks`: True when `step` can prefill part of a prompt: a sequence in
      `prefill` then stands for its chunk `prompt_token_ids[seq.prefilled:seq.prefill_to]`,
      to append to what the engine holds for it; its output is ignored (no token) until the
      chunk that ends the prompt. Only with a step budget (cadence.worker.step_budget).

    Only an engine's, with their defaults:

    - `start()`: load weights and warm up; the worker reports ready after this returns.
      Default: nothing to do (the constructor loaded the model).
    - `preempt(seq) -> list[int]`: drop what a running (or part-prefilled) sequence holds so
      that another can run; return the tokens to prefill when it is admitted again (its
      prompt and its outputs so far), from which it goes on as if never stopped. Default
      None: the engine cannot (--preempt then preempts nothing).
    - `text_piece_ids(text) -> list[int]`: an engine whose step may also return a `str` (a
      piece of text) or None (the sequence is done) for a sequence, instead of a token id,
      gives a piece's token ids with it; it needs a `tokenizer` too. StepFailed from it
      fails that one sequence. Such an engine's tokenizer is the user's: whatever its
      `encode`, `stream` (and the decoders it returns) raise, and text they give that
      cadence.engines.output_text finds fault with, fails that request alone. Default None:
      token ids only.
    - `step_errors`: a list that `step` fills with (sequence, Failure, message) for each
      sequence of the step that failed alone (a user's model gave a `SequenceError`, another
      exception or a bad output in its place); the batching loop ends those sequences with
      their failure, ignores their outputs, and empties the list. Default None: a step fails
      whole or not at all.
    - `tokenizer_name`: how messages name the tokenizer (`MyModel.tokenizer`).
    - `kv_cache_usage() -> float`: the share of its KV cache that sequences hold after a
      step, 0 to 1 (exported as `vllm:kv_cache_usage_perc`). Default 0: no cache to fill.
    - `first_step_ms`, `warm_step_ms`: the warm-up's first and last step times, reported with
      the worker's readiness. Default 0: not measured.
    - `close()`: tensor-parallel groups stop their ranks here.
    - `export_state(seq)`, `import_state(seq, data)`: as `cadence.Model`'s (disaggregated
      serving); `hands_off_state()` says whether the engine has them: by default, whether
      its class defines both (a `ModelEngine`: whether the user's model does).
    """

    name: str
    vocab_size: int

    preempt: Callable[[Sequence], list[int]] | None = None
    text_piece_ids: Callable[[str], list[int]] | None = None
    step_errors: list[tuple[Sequence, Failure, str]] | None = None
    tokenizer_name: str = "the model's tokenizer"
    first_step_ms: float = 0.0
    warm_step_ms: float = 0.0

    def start(self) -> None:
        return None

    def step(self, prefill: list[Sequence], decode: list[Sequence]) -> StepResult:
        """Run one step: prefill the new sequences, decode the others; one new token each
        (or, with `text_piece_ids`, a text piece or None), in the order `prefill + decode`.
        Raises StepFailed when only this step's sequences are lost."""
        raise NotImplementedError

    def kv_cache_usage(self) -> float:
        return 0.0

    def hands_off_state(self) -> bool:
        return member(self, "export_state") is not None and member(self, "import_state") is not None

    OWN: ClassVar[tuple[str, ...]] = (
        "start",
        "hands_off_state",
        "preempt",
        "text_piece_ids",
        "step_errors",
        "tokenizer_name",
        "kv_cache_usage",
        "first_step_ms",
        "warm_step_ms",
    )
    """The optional members only an engine has, each with its default above."""
