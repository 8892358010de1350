"""Continuous batching: new sequences join at step boundaries, each step emits one token per sequence.

With a step budget (cadence.worker.step_budget) a step prefills only the prompt tokens the
budget leaves beside its decodes: a long prompt, on an engine that takes prefill chunks, is
prefilled over several steps (the oldest prompt first) and gives its first token with its
last chunk; until then it is in `_prefilling` and produces nothing.

Waiting sequences are admitted by priority (`AddRequest.priority`, lower first, as vLLM's),
first come first served within one. With `preempt` (--preempt), a waiting sequence that finds
the batch full (--max-batch) or the KV cache full preempts the running one of the highest
priority value above its own (the latest arrived among equals): the engine drops its state
(`Engine.preempt`), it goes back to the waiting queue at its old place, and when admitted again
it prefills its prompt and the outputs it gave, then goes on with its next token: its stream
only waits.

A step runs in three phases, as vLLM's `EngineCore.step`: schedule (the step's sequences),
execute (the engine's step), update (its outputs into the step's message, each output's
finish decided by cadence.worker.stop_check).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple, cast

import msgspec

from cadence.byte_tokenizer import ByteTokenizer
from cadence.engines.base import Sequence, StepFailed, StepResult
from cadence.engines.engine import Engine
from cadence.engines.output_text import texts_problems
from cadence.transport.messages import RequestFailed, StateExport, StateImport, StepOutput
from cadence.vocabulary import AddRequest, Failure, Finish, prompt_over_limit
from cadence.worker.cpu_wait import ABSENT, CpuWait
from cadence.worker.step_budget import StepBudget
from cadence.worker.stop_check import check_stop

_BYTES = ByteTokenizer()
log = logging.getLogger("cadence.model")


class ScheduledStep(NamedTuple):
    """The schedule phase's hand-off to the engine: the sequences of one step."""

    prefill: list[Sequence]
    """Admitted sequences whose prompt (or its next chunk) the step processes."""
    decode: list[Sequence]
    """Running sequences, not paused: one output each."""
    imported: list[int]
    """Disaggregated serving: sequences taken in from other workers' prefills for this step."""


class EngineOutput(NamedTuple):
    """The execute phase's hand-off to the update: what the engine's step gave, and when."""

    outputs: StepResult
    """One per sequence of `prefill + decode`, in that order."""
    start_ns: int
    end_ns: int
    cpu_wait_ns: int = ABSENT
    """How long the engine's threads waited for a CPU since the previous step's end
    (`CpuWait`); ABSENT: not measured."""


class BatchScheduler:
    """Owns a worker's waiting queue and running batch, and turns one engine step into one message."""

    def __init__(
        self,
        engine: Engine,
        worker: int,
        max_batch: int,
        budget: StepBudget | None = None,
        *,
        preempt: bool = False,
        report_cached: bool = False,
        max_prompt_tokens: int | None = None,
        role: str = "",
        cpu_wait: CpuWait | None = None,
    ) -> None:
        self._engine = engine
        self._worker = worker
        self._max_batch = max_batch
        self._waiting: list[tuple[int, int, Sequence]] = []
        """A heap of (priority, arrival, sequence): the next to admit first."""
        self._arrivals = itertools.count()
        self._running: dict[int, Sequence] = {}
        self._prefilling: dict[int, Sequence] = {}
        """Admitted sequences part of whose prompt is still to prefill, oldest first."""
        self._budget = budget
        self._chunks = engine.takes_prefill_chunks
        """The engine prefills part of a prompt per step; without, a budget only limits the
        whole prompts a step admits."""
        self._paused: set[int] = set()
        """Sequences the steps skip: their clients are not reading (block policy). Mostly
        running ones; a paused sequence that was preempted stays paused while it waits, is
        admitted again (its re-prefill gives one output) and is then skipped like the others."""
        self._steps = 0
        # The engine's optional members, at their defaults where it has none
        # (cadence.engines.engine.Engine).
        self._reserve = engine.reserve
        self._tokenizer = engine.tokenizer
        self._kv_cache_usage = engine.kv_cache_usage
        self._text_piece_ids = engine.text_piece_ids
        """Set for an engine whose outputs may be text pieces or None (a user's model)."""
        self._step_errors = engine.step_errors
        """Filled by the engine's step with the sequences that failed alone (a user's model)."""
        self._tokenizer_name = engine.tokenizer_name
        self._streams_with = getattr(self._tokenizer, "streams_with", "stream")
        """The tokenizer's method that a sequence's decoder calls (named when it raises)."""
        self.failed: list[RequestFailed] = []
        """Sequences the last step lost alone (a user tokenizer's fault), to send after its
        output; the worker loop empties it."""
        self._preempt = engine.preempt if preempt else None
        self._max_prompt_tokens = max_prompt_tokens
        """--max-prompt-tokens for the prompts this worker tokenizes (the front checks its own)."""
        self._report_cached = report_cached
        """Send each sequence's `cached_tokens` with its first token (--prefix-caching)."""
        self.preemptions = 0
        self._hands_off = role == "prefill"
        """A prefill worker: each sequence leaves after its first token, as its state."""
        self._imports: deque[tuple[Sequence, bytes]] = deque()
        """Decode worker: sequences handed over with their states, taken into the batch in
        arrival order as it has room (`_admit_imports`)."""
        self._finished_prefill: list[tuple[Sequence, int | str | None]] = []
        """Prefill worker: the sequences of the last step that gave their first output and
        go on, with that output, to hand off (`export_states`)."""
        self._cpu_wait = cpu_wait
        """Read once per step, at its end (None: not measured)."""

    def add(self, request: AddRequest) -> RequestFailed | None:
        """Queue a request for the next step boundary, or say why the engine cannot run it."""
        seq = self._checked(request)
        if isinstance(seq, RequestFailed):
            return seq
        seq.arrival = next(self._arrivals)
        heapq.heappush(self._waiting, (seq.request.priority, seq.arrival, seq))
        return None

    def add_import(self, handed: StateImport) -> RequestFailed | None:
        """Queue a sequence another worker prefilled (disaggregated serving), to decode from
        its next output once the batch has room; or say why the engine cannot run it."""
        seq = self._checked(handed.request)
        if isinstance(seq, RequestFailed):
            return seq
        seq.arrival = next(self._arrivals)
        seq.generated = handed.generated
        seq.prefilled = seq.prefill_to = len(seq.prefill_ids)
        tokenizer = self._tokenizer
        if tokenizer is not None:
            try:
                seq.detokenize = tokenizer.stream(seq.prompt_token_ids)
                for token in handed.tokens:  # their text went out from the prefill worker
                    seq.detokenize(token, False)
            except Exception as exc:
                return self._lost(seq.seq_id, "stream", exc, "the prompt")
        self._imports.append((seq, handed.state))
        return None

    def _checked(self, request: AddRequest) -> Sequence | RequestFailed:
        """The request's sequence, its prompt tokenized where the front sent text, or why
        the engine cannot run it."""
        if request.prompt_text and not request.prompt_token_ids:
            # The front sent text: tokenize it with the model's own tokenizer (bytes if none).
            tokenizer = self._tokenizer or _BYTES
            try:
                ids = tokenizer.encode(request.prompt_text)
            except Exception as exc:
                return self._lost(request.seq_id, "encode", exc, "the prompt")
            request = msgspec.structs.replace(request, prompt_token_ids=ids)
            refusal = (
                None
                if self._max_prompt_tokens is None
                else prompt_over_limit(len(request.prompt_token_ids), self._max_prompt_tokens)
            )
            if refusal is not None:
                return RequestFailed(request.seq_id, Failure.INVALID_ARGUMENT, refusal)
        seq = Sequence(request)
        problem = self._engine.check(seq)
        if problem is not None:
            return RequestFailed(request.seq_id, Failure.INVALID_ARGUMENT, problem)
        return seq

    def abort(self, seq_ids: list[int]) -> None:
        """Drop sequences now, so none of them is in the next step."""
        for seq_id in seq_ids:
            self._paused.discard(seq_id)
            seq = self._running.pop(seq_id, None) or self._prefilling.pop(seq_id, None)
            if seq is not None:
                self._engine.release(seq)
        if seq_ids and self._waiting:
            gone = set(seq_ids)
            self._waiting = [e for e in self._waiting if e[2].seq_id not in gone]
            heapq.heapify(self._waiting)
        if seq_ids and self._imports:
            gone = set(seq_ids)
            self._imports = deque(e for e in self._imports if e[0].seq_id not in gone)

    def seq_ids(self) -> list[int]:
        """Every sequence the scheduler holds, running or waiting."""
        return [
            *self._running,
            *self._prefilling,
            *(e[2].seq_id for e in self._waiting),
            *(e[0].seq_id for e in self._imports),
        ]

    def pause(self, seq_ids: list[int]) -> None:
        """Skip these sequences at each step (they keep their place and engine state). One
        preempted since the front last heard of it is paused too, for when it runs again."""
        running, prefilling = self._running, self._prefilling
        for seq_id in seq_ids:
            if (
                seq_id in running
                or seq_id in prefilling
                or any(e[2].seq_id == seq_id for e in self._waiting)
                or any(e[0].seq_id == seq_id for e in self._imports)
            ):
                self._paused.add(seq_id)

    def resume(self, seq_ids: list[int]) -> None:
        self._paused.difference_update(seq_ids)

    @property
    def has_work(self) -> bool:
        """Something to step: waiting sequences, or running ones that are not all paused."""
        return (
            bool(self._waiting)
            or bool(self._prefilling)
            or bool(self._imports)
            or len(self._running) > len(self._paused)
        )

    def step(self) -> StepOutput | list[RequestFailed] | None:
        """One engine step, in three phases as vLLM's `EngineCore.step`: `schedule` picks
        the step's sequences, `execute` runs the engine on them, `update` turns its outputs
        into the step's message.

        Returns the step's output, or the failures of its sequences when the engine lost the
        step (StepFailed), or None when there was nothing to step. A sequence lost alone (the
        engine's `step_errors`: a user's model failed it; a user's tokenizer raised on it, or
        its decoder gave text cadence.engines.output_text refuses) is left out of the output
        and its failure put in `failed`.
        """
        scheduled = self.schedule()
        if scheduled is None:
            return None
        executed = self.execute(scheduled)
        if isinstance(executed, list):  # the engine lost the step
            return executed
        return self.update(scheduled, executed)

    def schedule(self) -> ScheduledStep | None:
        """The schedule phase: take in handed-over sequences, admit waiting ones (by priority,
        within --max-batch, the engine's `reserve` and the step budget; preempting with
        --preempt) and pick the running ones that are not paused; None when there is nothing
        to step."""
        paused = self._paused
        budget = self._budget
        imported = self._admit_imports() if self._imports else []
        if budget is None:
            prefill = self._admit_whole()
        else:
            prefill = self._admit_within_budget(budget, len(self._running) - len(paused))
        # After admission: a preemption may have taken a sequence out of the running ones.
        decode = (
            [s for s in self._running.values() if s.seq_id not in paused]
            if paused
            else (list(self._running.values()))
        )
        if not prefill and not decode:
            return None
        return ScheduledStep(prefill, decode, imported)

    def execute(self, scheduled: ScheduledStep) -> EngineOutput | list[RequestFailed]:
        """The execute phase: the engine's step on the scheduled sequences, timed; or, when
        the engine lost the step (StepFailed), the failures of its sequences, which are gone."""
        prefill, decode = scheduled.prefill, scheduled.decode
        start = time.monotonic_ns()
        try:
            outputs = self._engine.step(prefill, decode)
        except StepFailed as exc:
            if self._step_errors:
                self._step_errors.clear()
            return self._fail(prefill, decode, str(exc))
        end = time.monotonic_ns()
        self._steps += 1
        cpu_wait = self._cpu_wait
        return EngineOutput(outputs, start, end, cpu_wait.since_last() if cpu_wait else ABSENT)

    def update(self, scheduled: ScheduledStep, executed: EngineOutput) -> StepOutput:
        """The update phase: the step's message from the engine's outputs. Prefilled
        sequences join the running batch; each output is counted and `check_stop` decides
        whether it ends its sequence, which then leaves the batch and is released. This
        (through `_retire_tokens` or `_retire_pieces`) is the only place in the worker that
        loops over a step's outputs."""
        prefill, decode = scheduled.prefill, scheduled.decode
        stepped = prefill + decode
        tokens = executed.outputs
        start, end = executed.start_ns, executed.end_ns
        budget = self._budget
        if budget is not None:
            stepped, tokens = self._after_chunks(budget, prefill, decode, tokens, end - start)
        if self._step_errors:
            self._fail_alone(self._step_errors)
        prompt_lens, cached = self._start_running(prefill)
        if self.failed:
            lost = {f.seq_id for f in self.failed}
            kept = [i for i, seq in enumerate(stepped) if seq.seq_id not in lost]
            stepped, tokens = [stepped[i] for i in kept], [tokens[i] for i in kept]
        if self._hands_off:
            # The prefill part of `stepped` comes first: those whose prompt ended this step.
            self._finished_prefill = [
                (seq, out)
                for seq, out in zip(stepped, tokens)
                if seq.generated == 0 and seq.prefilled == len(seq.prefill_ids)
            ]
        texts: list[str] = []
        finished: list[int] = []
        reasons: list[int] = []
        piece_ids = self._text_piece_ids
        if piece_ids is not None:
            seq_ids, tokens, counts = self._retire_pieces(
                piece_ids, stepped, tokens, texts, finished, reasons
            )
            if texts:
                problems = texts_problems(texts)
                if problems:
                    counts = self._fail_texts(
                        problems, seq_ids, tokens, counts, texts, finished, reasons
                    )
            return StepOutput(
                self._worker,
                self._steps,
                start,
                end,
                seq_ids,
                tokens,
                finished,
                reasons,
                counts,
                texts,
                prompt_lens,
                self._kv_cache_usage(),
                cached,
                bool(counts),
                scheduled.imported,
                executed.cpu_wait_ns,
            )
        ids = cast("list[int]", tokens)  # no text_piece_ids: token ids alone (base.StepResult)
        seq_ids = self._retire_tokens(stepped, ids, texts, finished, reasons)
        return StepOutput(
            self._worker,
            self._steps,
            start,
            end,
            seq_ids,
            ids,
            finished,
            reasons,
            texts=texts,
            prompt_lens=prompt_lens,
            kv_cache_usage=self._kv_cache_usage(),
            cached_tokens=cached,
            imported=scheduled.imported,
            cpu_wait_ns=executed.cpu_wait_ns,
        )

    def _start_running(self, prefill: list[Sequence]) -> tuple[dict[int, int], dict[int, int]]:
        """The step's prefilled sequences whose prompt is now all processed join the running
        batch; those starting their output get their detokenizer (a tokenizer that raises
        fails the sequence alone, into `failed`). Returns the prompt lengths of prompts this
        worker tokenized and the prefix cache's tokens (--prefix-caching), by sequence, for
        the step's message."""
        running = self._running
        tokenizer = self._tokenizer
        prompt_lens: dict[int, int] = {}
        cached: dict[int, int] = {}
        lost = {f.seq_id for f in self.failed} if self.failed else ()
        for seq in prefill:
            request = seq.request
            seq.prefilled = seq.prefill_to
            if seq.prefilled < len(seq.prefill_ids) or seq.seq_id in lost:
                continue  # a chunk (no output until the prompt's last one), or failed
            running[seq.seq_id] = seq
            if seq.generated:
                continue  # back after a preemption: its stream knows its prompt already
            if request.prompt_text:
                prompt_lens[seq.seq_id] = len(request.prompt_token_ids)
            if self._report_cached:
                cached[seq.seq_id] = seq.cached_tokens
            if tokenizer is not None:
                try:
                    seq.detokenize = tokenizer.stream(request.prompt_token_ids)
                except Exception as exc:
                    self._drop(seq)
                    self.failed.append(self._lost(seq.seq_id, "stream", exc, "the prompt"))
        return prompt_lens, cached

    def _retire_tokens(
        self,
        stepped: list[Sequence],
        ids: list[int],
        texts: list[str],
        finished: list[int],
        reasons: list[int],
    ) -> list[int]:
        """The step loop for an engine that outputs token ids: count each sequence's token,
        end it where `check_stop` says (the last token's text also flushes an incomplete
        character) and release it; fills `texts` (with a tokenizer), `finished` and
        `reasons`. Returns the sequences' ids, in the order of `ids`."""
        running = self._running
        paused = self._paused
        tokenizer = self._tokenizer
        seq_ids: list[int] = []
        check = check_stop  # a local: one lookup per step, not per token
        for seq, token in zip(stepped, ids):
            seq.generated += 1
            seq_ids.append(seq.seq_id)
            reason = check(token, seq.generated, seq.request.max_tokens, seq.stop_token_ids)
            if tokenizer is not None:  # the last token's text flushes an incomplete character
                texts.append(seq.detokenize(token, reason != 0))  # type: ignore[misc]  # set with the tokenizer at the first prefill
            if reason:  # not Finish.NONE (0)
                finished.append(seq.seq_id)
                reasons.append(reason)
                del running[seq.seq_id]
                paused.discard(seq.seq_id)  # one paused when preempted ends in its re-prefill
                self._engine.release(seq)
        return seq_ids

    def _admit_imports(self) -> list[int]:
        """Decode worker: take handed-over sequences into the batch, oldest first, while it
        has room (--max-batch) and the engine takes their state (`import_state`: False when
        its cache has no room yet); the rest wait, and so does the front's queue behind them.
        A sequence whose import raised fails alone, as one whose export raised does."""
        imports, running = self._imports, self._running
        load = self._engine.import_state  # an engine that has it (checked at start-up)
        taken: list[int] = []
        while imports and len(running) + len(self._prefilling) < self._max_batch:
            seq, state = imports[0]
            try:
                loaded = load(seq, state)
            except Exception as exc:
                imports.popleft()
                log.error("import_state raised on request %d", seq.seq_id, exc_info=exc)
                self.failed.append(_state_raised("import_state", seq.seq_id, exc))
                continue
            if not loaded:
                break
            imports.popleft()
            running[seq.seq_id] = seq
            taken.append(seq.seq_id)
        return taken

    def export_states(self) -> list[StateExport | RequestFailed]:
        """Prefill worker, after the step's output went out: each sequence that gave its first
        output in it and goes on leaves this worker as its state (`export_state`), its engine
        room freed; a sequence whose export raised fails alone."""
        found, self._finished_prefill = self._finished_prefill, []
        sent: list[StateExport | RequestFailed] = []
        export = self._engine.export_state  # an engine that has it (checked at start-up)
        for seq, out in found:
            if self._running.pop(seq.seq_id, None) is None:
                continue  # finished by its first output, or failed
            self._paused.discard(seq.seq_id)
            try:
                state = export(seq)
            except Exception as exc:
                log.error("export_state raised on request %d", seq.seq_id, exc_info=exc)
                sent.append(_state_raised("export_state", seq.seq_id, exc))
            else:
                tokens = [out] if type(out) is int else []
                sent.append(
                    StateExport(
                        self._worker,
                        seq.seq_id,
                        seq.generated,
                        tokens,
                        state,
                        time.monotonic_ns(),
                    )
                )
            self._engine.release(seq)
        return sent

    def _admit_whole(self) -> list[Sequence]:
        """No budget: admit waiting sequences up to max_batch, each prompt whole in this step."""
        waiting = self._waiting
        prefill: list[Sequence] = []
        while waiting:
            seq = waiting[0][2]
            fits = self._room_for(seq, prefill, len(self._running) + len(prefill))
            if fits is None:
                continue
            if not fits:
                break
            prefill.append(self._take())
        return prefill

    def _admit_within_budget(self, budget: StepBudget, decodes: int) -> list[Sequence]:
        """The sequences this step prefills, each with its chunk set (`prefill_to`): first
        the prompts already part-prefilled, by priority then age, then waiting ones by
        priority then arrival, until the budget's prefill tokens are spent. An engine that
        takes no chunks gets whole prompts that fit what is left (the step's first one
        whatever its length). Tokens the prefix cache holds cost nothing."""
        left = budget.prefill_tokens(decodes)
        prefill: list[Sequence] = []
        prefilling = self._prefilling
        part: Iterable[Sequence] = prefilling.values()
        if len(prefilling) > 1:
            part = sorted(part, key=lambda s: (s.request.priority, s.arrival))
        for seq in part:
            if left <= 0:
                return prefill
            seq.prefill_to = min(len(seq.prefill_ids), seq.prefilled + left)
            left -= seq.prefill_to - seq.prefilled
            prefill.append(seq)
        waiting = self._waiting
        chunks = self._chunks
        while left > 0 and waiting:
            seq = waiting[0][2]
            length = len(seq.prefill_ids)
            if chunks:
                seq.prefill_to = min(length, left)  # at most: the cache may hold some
            elif length > left and prefill:
                break
            fits = self._room_for(seq, prefill, len(self._running) + len(prefilling))
            if fits is None:
                continue
            if not fits:
                break
            self._take()
            if chunks:
                seq.prefill_to = min(length, seq.prefilled + left)
            prefill.append(seq)
            prefilling[seq.seq_id] = seq
            left -= seq.prefill_to - seq.prefilled
        return prefill

    def _room_for(self, seq: Sequence, admitted: list[Sequence], occupied: int) -> bool | None:
        """Whether the next waiting sequence, `seq`, is admitted now (the engine's `reserve`
        done): True; False: it waits, and those behind it with it; None: a preemption made
        room, ask again. `occupied`: the batch's sequences, this step's `admitted` included."""
        if occupied >= self._max_batch:
            return None if self._make_room(seq, admitted) else False
        if not self._reserve(seq):
            # A refusal with sequences admitted already may be the step's prefill limit,
            # which no preemption lifts; the first one's is the KV cache's.
            return None if not admitted and self._make_room(seq, admitted) else False
        return True

    def _take(self) -> Sequence:
        """The next waiting sequence, admitted."""
        seq = heapq.heappop(self._waiting)[2]
        seq.cached_tokens = seq.cached_tokens or seq.prefilled
        return seq

    def _make_room(self, seq: Sequence, admitted: list[Sequence]) -> bool:
        """--preempt: preempt the running or part-prefilled sequence of the highest priority
        value above `seq`'s (the latest arrived among equals), not one of this step's
        `admitted`; False when there is none (or preemption is off)."""
        preempt = self._preempt
        if preempt is None:
            return False
        priority = seq.request.priority
        taken = {s.seq_id for s in admitted}
        victim: Sequence | None = None
        worst = (priority, -1)
        for candidate in (*self._running.values(), *self._prefilling.values()):
            key = (candidate.request.priority, candidate.arrival)
            if key > worst and key[0] > priority and candidate.seq_id not in taken:
                victim, worst = candidate, key
        if victim is None:
            return False
        seq_id = victim.seq_id
        self._running.pop(seq_id, None)
        self._prefilling.pop(seq_id, None)
        # A paused victim stays in `_paused`: its client still reads nothing, and the front,
        # which paused it once, does not know it was preempted.
        victim.prefill_ids = preempt(victim)
        victim.prefilled = 0
        victim.prefill_to = len(victim.prefill_ids)
        heapq.heappush(self._waiting, (victim.request.priority, victim.arrival, victim))
        self.preemptions += 1
        return True

    def _after_chunks(
        self,
        budget: StepBudget,
        prefill: list[Sequence],
        decode: list[Sequence],
        outputs: StepResult,
        duration_ns: int,
    ) -> tuple[list[Sequence], StepResult]:
        """Tell the budget what the step cost; drop the outputs of sequences whose prompt is
        not all prefilled yet (they stay in `_prefilling`), and take the rest out of it."""
        tokens = 0
        chunked = 0
        prefilling = self._prefilling
        for seq in prefill:
            tokens += seq.prefill_to - seq.prefilled
            if seq.prefill_to < len(seq.prefill_ids):
                chunked += 1
            else:
                del prefilling[seq.seq_id]
        budget.observe(len(decode), tokens, duration_ns / 1e9)
        if not chunked:
            return prefill + decode, outputs
        n = len(prefill)
        done = [i for i, seq in enumerate(prefill) if seq.prefill_to == len(seq.prefill_ids)]
        return ([prefill[i] for i in done] + decode, [outputs[i] for i in done] + outputs[n:])

    def _retire_pieces(
        self,
        piece_ids: Callable[[str], list[int]],
        stepped: list[Sequence],
        outputs: StepResult,
        texts: list[str],
        finished: list[int],
        reasons: list[int],
    ) -> tuple[list[int], list[int], list[int]]:
        """The step loop for an engine whose output for a sequence may also be a text piece
        (`str`: its text as given, its ids from the engine) or None (the sequence is done,
        STOP, with no output). Each output counts as one toward max_tokens; stop tokens are
        looked for among the int outputs (`check_stop` decides both). Returns the pieces' seq_ids, token ids and token
        counts (empty when every piece is one token: StepOutput's one-token layout)."""
        running = self._running
        seq_ids: list[int] = []
        token_ids: list[int] = []
        counts: list[int] = []
        several = False
        for seq, out in zip(stepped, outputs):
            if out is None:
                reason = Finish.STOP
            else:
                seq.generated += 1
                if type(out) is str:
                    try:
                        ids = piece_ids(out)
                    except StepFailed as exc:  # this sequence's output alone
                        self._drop(seq)
                        self.failed.append(RequestFailed(seq.seq_id, Failure.INTERNAL, str(exc)))
                        continue
                    except Exception as exc:
                        self._drop(seq)
                        self.failed.append(
                            self._lost(seq.seq_id, "encode", exc, "a text piece the model returned")
                        )
                        continue
                    reason = check_stop(
                        None, seq.generated, seq.request.max_tokens, seq.stop_token_ids
                    )
                    text = out
                    token_ids += ids
                    several = several or len(ids) != 1
                    counts.append(len(ids))
                else:
                    # An int: `type() is str` (cheaper per output than isinstance) leaves
                    # mypy the union.
                    token: int = out  # type: ignore[assignment]  # see above
                    reason = check_stop(
                        token, seq.generated, seq.request.max_tokens, seq.stop_token_ids
                    )
                    try:
                        text = seq.detokenize(token, reason != Finish.NONE)  # type: ignore[misc]  # a model's tokenizer is never None: ByteText
                    except Exception as exc:
                        self._drop(seq)
                        self.failed.append(
                            self._lost(seq.seq_id, self._streams_with, exc, f"token {token}")
                        )
                        continue
                    token_ids.append(token)
                    counts.append(1)
                seq_ids.append(seq.seq_id)
                texts.append(text)
            if reason:
                finished.append(seq.seq_id)
                reasons.append(reason)
                del running[seq.seq_id]
                self._paused.discard(seq.seq_id)
                self._engine.release(seq)
        return seq_ids, token_ids, counts if several else []

    def _fail_alone(self, errors: list[tuple[Sequence, Failure, str]]) -> None:
        """End the sequences the engine's step failed one by one (`step_errors`, emptied)."""
        for seq, failure, message in errors:
            self._drop(seq)
            self.failed.append(RequestFailed(seq.seq_id, failure, message))
        errors.clear()

    def _drop(self, seq: Sequence) -> None:
        """Take a sequence out of the batch and release it: it failed alone."""
        self._running.pop(seq.seq_id, None)
        self._prefilling.pop(seq.seq_id, None)
        self._paused.discard(seq.seq_id)
        self._engine.release(seq)

    def _lost(self, seq_id: int, method: str, exc: Exception, on: str) -> RequestFailed:
        """A request's failure because the model's tokenizer raised in `method` on `on`.
        Logged with its traceback: not on the token path, and what the model's author needs."""
        name = f"{self._tokenizer_name}.{method}"
        log.error("%s raised on %s of request %d", name, on, seq_id, exc_info=exc)
        return RequestFailed(
            seq_id,
            Failure.INTERNAL,
            f"{name} raised {type(exc).__name__}: {exc} (on {on}); fix the tokenizer",
        )

    def _fail_texts(
        self,
        problems: list[tuple[int, str]],
        seq_ids: list[int],
        token_ids: list[int],
        counts: list[int],
        texts: list[str],
        finished: list[int],
        reasons: list[int],
    ) -> list[int]:
        """Take the pieces `problems` names (index into `seq_ids`, the texts a tokenizer's
        decoder gave that no message can carry or that are too large) out of this step's
        output, in place, and fail their sequences; returns the new counts."""
        bad = dict(problems)
        ids = list(token_ids)
        counts = counts or [1] * len(seq_ids)
        keep_ids: list[int] = []
        keep_tokens: list[int] = []
        keep_counts: list[int] = []
        keep_texts: list[str] = []
        offset = 0
        for i, seq_id in enumerate(seq_ids):
            count = counts[i]
            if i in bad:
                seq = self._running.get(seq_id)
                if seq is not None:
                    self._drop(seq)
                if seq_id in finished:
                    at = finished.index(seq_id)
                    del finished[at], reasons[at]
                self.failed.append(
                    RequestFailed(
                        seq_id,
                        Failure.INTERNAL,
                        f"{self._tokenizer_name}.{self._streams_with} gave {bad[i]}",
                    )
                )
            else:
                keep_ids.append(seq_id)
                keep_tokens += ids[offset : offset + count]
                keep_counts.append(count)
                keep_texts.append(texts[i])
            offset += count
        seq_ids[:], token_ids[:], texts[:] = keep_ids, keep_tokens, keep_texts
        return keep_counts if any(c != 1 for c in keep_counts) else []

    def _fail(
        self, prefill: list[Sequence], decode: list[Sequence], message: str
    ) -> list[RequestFailed]:
        """The engine lost a step: its sequences end with INTERNAL; the others go on."""
        for seq in decode:
            del self._running[seq.seq_id]
        for seq in prefill:
            self._prefilling.pop(seq.seq_id, None)
        for seq in prefill + decode:
            self._paused.discard(seq.seq_id)
            self._engine.release(seq)
        return [RequestFailed(seq.seq_id, Failure.INTERNAL, message) for seq in prefill + decode]


def _state_raised(member: str, seq_id: int, exc: Exception) -> RequestFailed:
    """The failure of a sequence whose hand-off (`export_state`, `import_state`) raised."""
    return RequestFailed(
        seq_id, Failure.INTERNAL, f"the engine's {member} raised {type(exc).__name__}: {exc}"
    )
