"""A user's batched model as an engine of the worker's batching loop (`cadence serve
--engine MODULE:CLASS`, `cadence.serve(MyModel)`; docs/models.md is the user's page).

    class MyModel:
        def __init__(self, device: str): ...      # + rank=, group_size=, ... if it takes them
        def step(self, prefill: list[Sequence], decode: list[Sequence]) -> list[int | str | None]
        def release(self, seq: Sequence) -> None: ...   # finished or aborted: free its state

`ModelEngine` wraps such an object into the `Engine` protocol, so it runs on the same
`BatchScheduler` as the built-in engines (a class with `generate_stream(batch)` instead of
`step` goes through cadence.engines.batch_generator first). What it adds is what a user's code cannot be
trusted with: a step that raises or returns the wrong container (the wrong number of
outputs, an iterator that raises) fails that step's sequences (`StepFailed`), not the worker;
an exception (`cadence.SequenceError` or any other) or a bad output (a text over
cadence.engines.output_text's bound or not valid Unicode, an id outside the vocabulary) in a
sequence's place fails that sequence alone (`step_errors`); a `release` or `check` that
raises is logged; a tokenizer with only encode/decode is given incremental detokenization;
no tokenizer means bytes.
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import cast

from cadence.config import EngineConfig
from cadence.engines.app import load_app
from cadence.engines.base import EngineLoadError, Sequence, SequenceError, StepFailed
from cadence.engines.detokenizer import piece_encoder, prompt_decoder, text_streams
from cadence.engines.model_api import member, misspelled_members
from cadence.engines.output_text import MAX_OUTPUT_TOKENS, ids_problem, text_problem
from cadence.vocabulary import AddRequest, Failure
from cadence.wording import counted

log = logging.getLogger("cadence.model")

CONSTRUCTOR_KEYWORDS = ("rank", "group_size", "worker", "model", "dtype")
"""What a model's constructor may take besides the device, each given only when its
signature names it (or takes **kwargs): its tensor-parallel rank and group size, the worker's
number, and the server's --model and --dtype values."""


def load_model_class(reference: str) -> type:
    """Import the class named `module:Class` (or `path/to/file.py:Class`); EngineLoadError
    says what is wrong in one line."""
    try:
        target = load_app(reference)
    except Exception as exc:
        raise EngineLoadError(
            f"cannot load model {reference!r}: {type(exc).__name__}: {exc}"
        ) from None
    if not inspect.isclass(target):
        raise EngineLoadError(
            f"{reference} is a {type(target).__name__}, not a class; serve a generator "
            "function with --app instead, or name a class with step(prefill, decode)"
        )
    if not (
        callable(getattr(target, "step", None))
        or callable(getattr(target, "generate_stream", None))
    ):
        raise EngineLoadError(
            f"{reference} has no step(prefill, decode) method (nor "
            "generate_stream(batch)); see docs/models.md"
        )
    return target


def construct(cls: type, device: str, offered: dict[str, object]) -> object:
    """`cls(device, **the offered keywords its constructor takes)`; EngineLoadError if it raises."""
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read (a C extension's class)
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_any or k in params}
    if offered.get("group_size", 1) != 1 and not {"rank", "group_size"} <= kwargs.keys():
        raise EngineLoadError(
            f"--tp {offered['group_size']}: {cls.__qualname__}.__init__ must take rank= and "
            "group_size= to learn its place in the tensor-parallel group (see docs/models.md)"
        )
    try:
        return cls(device, **kwargs)
    except Exception as exc:
        log.debug("constructing %s failed", cls.__qualname__, exc_info=exc)
        raise EngineLoadError(
            f"{cls.__qualname__}({device!r}) raised {type(exc).__name__}: {exc}"
        ) from None


class ModelEngine:
    """A user's model object behind the `Engine` protocol (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        device: str,
        *,
        rank: int = 0,
        group_size: int = 1,
        dist_init: str = "",
        worker: int = 0,
    ) -> None:
        cls = load_model_class(config.model_class)
        self.name = config.model_class
        self._label = cls.__qualname__
        self.group = None
        if group_size > 1:
            # Before the model exists, so that its constructor can use torch.distributed.
            from cadence.engines.model_group import StepGroup

            self.group = StepGroup(rank, group_size, dist_init, device)
        model = construct(
            cls,
            device,
            {
                "rank": rank,
                "group_size": group_size,
                "worker": worker,
                "model": config.model,
                "dtype": config.dtype,
            },
        )
        self.model = model
        if worker == 0 and rank == 0:  # once per server, before it serves
            for line in misspelled_members(cls):
                log.warning("cadence: %s", line)
        self._release = member(model, "release")
        self._check = member(model, "check")
        own_max = member(model, "max_batch")
        self.max_batch = min(config.max_batch, int(own_max)) if own_max else config.max_batch
        self.step_errors: list[tuple[Sequence, Failure, str]] = []
        """Sequences of the last step that failed alone (see cadence.engines.base.Engine)."""
        self._arrived: Callable[[], None] | None = None
        """The batch-generator shape: told of each accepted request (it gathers batches)."""
        self.takes_prefill_chunks = False
        """The class opted in (`takes_prefill_chunks = True`): under a step budget its step may
        be given part of a prompt (`Sequence.prefilled` to `prefill_to`)."""
        self._step: Callable[[list[Sequence], list[Sequence]], object]
        """The model's step, or its generate_stream behind a BatchGenerator."""
        step = getattr(model, "step", None)
        if callable(step):
            self._step = step
            self._step_name = "step"
            # Not across a tensor-parallel group: its followers rebuild whole-prompt steps.
            self.takes_prefill_chunks = (
                member(model, "takes_prefill_chunks") is True and self.group is None
            )
            reserve = member(model, "reserve")
            if callable(reserve):
                self.reserve = reserve
        else:
            from cadence.engines.batch_generator import BatchGenerator

            # load_model_class checked: without a step, the class has generate_stream.
            shape = BatchGenerator(
                member(model, "generate_stream"),
                self._label,
                self.max_batch,
                config.batch_timeout_ms / 1e3,
                self._release,
            )
            self._step, self._release, self.reserve = shape.step, shape.release, shape.reserve
            self._arrived = shape.arrived
            self._step_name = "generate_stream"
        export, load = member(model, "export_state"), member(model, "import_state")
        if callable(export) and callable(load) and self.group is None:
            # Disaggregated serving: looked up by the worker (cadence.worker.process).
            self.export_state, self.import_state = export, load
        tokenizer = member(model, "tokenizer")
        try:
            self.tokenizer = text_streams(tokenizer)
        except TypeError as exc:
            raise EngineLoadError(f"{self._label}.tokenizer: {exc}") from None
        self._encode_piece = piece_encoder(self.tokenizer)
        self._decode_prompt = prompt_decoder(self.tokenizer)
        """Gives a prompt sent as token ids its text; None (a tokenizer that streams on its
        own without `decode`): such prompts are refused in `check`."""
        self.tokenizer_name = f"{self._label}.tokenizer"
        """How the worker names the model's tokenizer when one of its methods raises."""
        self._bytes_only = tokenizer is None
        self.vocab_size = getattr(self.tokenizer, "vocab_size", None) or 0
        """0: the tokenizer does not say, and prompt ids are not checked against it."""

    def text_piece_ids(self, text: str) -> list[int]:
        """The token ids of a `str` output: its bytes, or the tokenizer's encoding of it
        without special tokens. StepFailed (that sequence's alone) when they are more than
        one output may hold (cadence.engines.output_text)."""
        ids = self._encode_piece(text)
        if len(ids) > MAX_OUTPUT_TOKENS:
            raise StepFailed(
                f"{self._label}.{self._step_name} returned a text of {ids_problem(len(ids))}"
            )
        return ids

    def start(self) -> None:
        """The constructor loaded the model."""

    def check(self, request: AddRequest) -> str | None:
        """Prompt ids within the vocabulary, then the model's own `check(seq)` if it has one."""
        prompt = request.prompt_token_ids
        vocab = self.vocab_size
        if vocab and prompt and not (0 <= min(prompt) and max(prompt) < vocab):
            bad = next(t for t in prompt if not 0 <= t < vocab)
            return f"prompt_token_ids must be in [0, {vocab}); got {bad}"
        if prompt and not request.prompt_text and self._decode_prompt is None:
            return (
                f"{self.tokenizer_name} has no decode(ids), so this model cannot read a "
                "prompt sent as token ids; send the prompt as text"
            )
        problem = None if self._check is None else self._checked_by_model(request)
        if problem is None and self._arrived is not None:
            self._arrived()
        return problem

    def _checked_by_model(self, request: AddRequest) -> str | None:
        seq = Sequence(request)
        try:
            self._prepare([seq])
        except Exception as exc:
            log.error(
                "%s.decode raised on request %d's prompt",
                self.tokenizer_name,
                seq.seq_id,
                exc_info=exc,
            )
            return f"{self.tokenizer_name}.decode raised {type(exc).__name__}: {exc}"
        try:
            return self._check(seq)
        except Exception as exc:
            log.error("%s.check raised on request %d", self._label, seq.seq_id, exc_info=exc)
            return f"{self._label}.check raised {type(exc).__name__}: {exc}"

    def step(self, prefill: list[Sequence], decode: list[Sequence]) -> list[int | str | None]:
        """The model's step, its outputs checked; StepFailed fails this step's sequences,
        `step_errors` lists those that failed alone."""
        try:
            if prefill:
                self._prepare(prefill)
            if self.group is not None:
                self.group.send_step(prefill, decode)
            outputs = self._step(prefill, decode)
        except Exception as exc:
            # Not on the token path: the traceback is what the model's author needs.
            name = f"{self._label}.{self._step_name}"
            log.error("%s raised", name, exc_info=exc)
            raise StepFailed(f"{name} raised {type(exc).__name__}: {exc}") from None
        return self._checked(outputs, prefill, decode)

    def release(self, seq: Sequence) -> None:
        if self.group is not None:
            self.group.released(seq.seq_id)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        """The model's `release`, on any rank."""
        if self._release is None:
            return
        try:
            self._release(seq)
        except Exception as exc:
            log.error("%s.release raised on request %d", self._label, seq.seq_id, exc_info=exc)

    def follow(self) -> None:
        """Tensor-parallel followers (rank > 0): step the model as rank 0 does, until it stops."""
        assert self.group is not None
        try:
            self.group.follow(self._step, self._free, self._prepare)
        finally:
            self.close()

    def close(self) -> None:
        try:
            close = member(self.model, "close")
            if close is not None:
                close()
        finally:
            if self.group is not None:
                self.group.close()

    def _prepare(self, seqs: list[Sequence]) -> None:
        """Give sequences that came as token ids their prompt text too."""
        decode = self._decode_prompt
        if decode is None:  # `check` refused prompts sent as token ids
            return
        for seq in seqs:
            if not seq.prompt:
                seq.prompt = decode(seq.request.prompt_token_ids)

    def _checked(
        self, outputs: object, prefill: list[Sequence], decode: list[Sequence]
    ) -> list[int | str | None]:
        """`outputs` as a list of int, str or None, one per sequence, or StepFailed."""
        name = f"{self._label}.{self._step_name}"
        if type(outputs) is not list:
            returned = type(outputs).__name__
            try:
                # A tuple, a numpy array, ...: TypeError for what is not iterable; each
                # item is checked below (a bad one fails its sequence, its place ignored).
                items = iter(cast("Iterable[int | str | None]", outputs))
            except TypeError:
                raise StepFailed(
                    f"{name} returned a {returned}; return a list with one output per sequence"
                ) from None
            try:
                outputs = list(items)
            except Exception as exc:  # the model's own iterator: its failure is the step's
                log.error("%s returned a %s that raised", name, returned, exc_info=exc)
                raise StepFailed(
                    f"{name} returned a {returned} whose iteration raised "
                    f"{type(exc).__name__}: {exc}; return a list with one output "
                    "per sequence"
                ) from None
        count = len(prefill) + len(decode)
        if len(outputs) != count:
            raise StepFailed(
                f"{name} returned {counted(len(outputs), 'output')} for "
                f"{counted(count, 'sequence')}; return one per sequence, in "
                "prefill + decode order"
            )
        limit = self.vocab_size or None
        for i, out in enumerate(outputs):
            kind = type(out)
            if kind is str:
                problem = text_problem(out)
                if problem is not None:
                    self._failed_alone(prefill, decode, i, f"{name} returned {problem}")
                continue
            if out is None:
                continue
            if kind is not int:
                if isinstance(out, Exception):  # that sequence's own failure
                    self._failed_alone(prefill, decode, i, *self._error_of(name, out))
                    continue
                try:
                    out = outputs[i] = operator.index(out)  # numpy and torch integers
                except TypeError:
                    self._failed_alone(
                        prefill,
                        decode,
                        i,
                        f"{name} returned a {kind.__name__} for this "
                        "request; return an int (token id), a str (text), None (done) or an "
                        "exception (this request failed)",
                    )
                    continue
            if out < 0 or (limit is not None and out >= limit):
                self._failed_alone(
                    prefill,
                    decode,
                    i,
                    f"{name} returned token id {out}, "
                    + (
                        "but the model has no tokenizer, so ids are bytes (0..255): give the class "
                        "a `tokenizer` or return str pieces"
                        if self._bytes_only
                        else f"outside its tokenizer's vocabulary [0, {limit})"
                        if limit
                        else "which is negative"
                    ),
                )
        return outputs

    def _failed_alone(
        self,
        prefill: list[Sequence],
        decode: list[Sequence],
        i: int,
        message: str,
        failure: Failure = Failure.INTERNAL,
    ) -> None:
        """The sequence at `i` (in prefill + decode) failed alone: the batching loop ends it
        with `failure` and `message` and ignores its output (`step_errors`)."""
        seq = prefill[i] if i < len(prefill) else decode[i - len(prefill)]
        self.step_errors.append((seq, failure, message))

    def _error_of(self, name: str, error: Exception) -> tuple[str, Failure]:
        """The message and failure of an exception a model put in a sequence's place: a
        SequenceError's own, else INTERNAL naming the model and the exception (logged, with
        its traceback if it was raised: what the model's author needs)."""
        if isinstance(error, SequenceError):
            return error.message, Failure[error.status]
        log.error(
            "%s gave %s for a request",
            name,
            type(error).__name__,
            exc_info=error if error.__traceback__ is not None else None,
        )
        return f"{name} failed this request: {type(error).__name__}: {error}", Failure.INTERNAL
