"""Continuous batching: new sequences join at step boundaries, each step emits one token per sequence."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import msgspec

from cadence.byte_tokenizer import ByteTokenizer
from cadence.engines.base import Engine, Sequence
from cadence.transport.messages import AddRequest, Failure, Finish, RequestFailed, StepOutput

_BYTES = ByteTokenizer()


class BatchScheduler:
    """Owns a worker's waiting queue and running batch, and turns one engine step into one message."""

    def __init__(self, engine: Engine, worker: int, max_batch: int) -> None:
        self._engine = engine
        self._worker = worker
        self._max_batch = max_batch
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}
        self._paused: set[int] = set()
        """Running sequences the steps skip: their clients are not reading (block policy)."""
        self._steps = 0
        # Optional engine capabilities (see cadence.engines.base.Engine).
        self._reserve: Callable[[Sequence], bool] | None = getattr(engine, "reserve", None)
        self._tokenizer = getattr(engine, "tokenizer", None)

    def add(self, request: AddRequest) -> RequestFailed | None:
        """Queue a request for the next step boundary, or say why the engine cannot run it."""
        if request.prompt_text and not request.prompt_token_ids:
            # The front sent text: tokenize it with the model's own tokenizer (bytes if none).
            tokenizer = self._tokenizer or _BYTES
            request = msgspec.structs.replace(
                request, prompt_token_ids=tokenizer.encode(request.prompt_text)
            )
        problem = self._engine.check(request)
        if problem is not None:
            return RequestFailed(request.seq_id, Failure.INVALID_ARGUMENT, problem)
        self._waiting.append(Sequence(request))
        return None

    def abort(self, seq_ids: list[int]) -> None:
        """Drop sequences now, so none of them is in the next step."""
        for seq_id in seq_ids:
            self._paused.discard(seq_id)
            seq = self._running.pop(seq_id, None)
            if seq is not None:
                self._engine.release(seq)
        if seq_ids and self._waiting:
            gone = set(seq_ids)
            self._waiting = deque(s for s in self._waiting if s.seq_id not in gone)

    def seq_ids(self) -> list[int]:
        """Every sequence the scheduler holds, running or waiting."""
        return [*self._running, *(s.seq_id for s in self._waiting)]

    def pause(self, seq_ids: list[int]) -> None:
        """Skip these sequences at each step (they keep their place and engine state)."""
        self._paused.update(s for s in seq_ids if s in self._running)

    def resume(self, seq_ids: list[int]) -> None:
        self._paused.difference_update(seq_ids)

    @property
    def has_work(self) -> bool:
        """Something to step: waiting sequences, or running ones that are not all paused."""
        return bool(self._waiting) or len(self._running) > len(self._paused)

    def step(self) -> StepOutput | None:
        """Admit waiting sequences, run one engine step, retire finished sequences.

        This is the only place in the worker that loops over a step's tokens.
        """
        room = min(self._max_batch - len(self._running), len(self._waiting))
        reserve = self._reserve
        if reserve is None:
            prefill = [self._waiting.popleft() for _ in range(room)]
        else:
            # In arrival order; one that does not fit yet (KV cache full) holds the rest back.
            prefill = []
            while len(prefill) < room and reserve(self._waiting[0]):
                prefill.append(self._waiting.popleft())
        paused = self._paused
        decode = [s for s in self._running.values() if s.seq_id not in paused] if paused else (
            list(self._running.values()))
        if not prefill and not decode:
            return None
        start = time.monotonic_ns()
        tokens = self._engine.step(prefill, decode)
        end = time.monotonic_ns()
        self._steps += 1
        seq_ids: list[int] = []
        finished: list[int] = []
        reasons: list[int] = []
        running = self._running
        tokenizer = self._tokenizer
        texts: list[str] = []
        prompt_lens: dict[int, int] = {}
        for seq in prefill:
            running[seq.seq_id] = seq
            request = seq.request
            if request.prompt_text:
                prompt_lens[seq.seq_id] = len(request.prompt_token_ids)
            if tokenizer is not None:
                seq.detokenize = tokenizer.stream(request.prompt_token_ids)
        for seq, token in zip(prefill + decode, tokens):
            seq.generated += 1
            seq_ids.append(seq.seq_id)
            if token in seq.stop_token_ids:
                reason = Finish.STOP
            elif seq.generated >= seq.request.max_tokens:
                reason = Finish.LENGTH
            else:
                if tokenizer is not None:
                    texts.append(seq.detokenize(token, False))
                continue
            if tokenizer is not None:  # the last piece also flushes an incomplete character
                texts.append(seq.detokenize(token, True))
            finished.append(seq.seq_id)
            reasons.append(reason)
            del running[seq.seq_id]
            self._engine.release(seq)
        return StepOutput(
            self._worker, self._steps, start, end, seq_ids, tokens, finished, reasons,
            texts=texts, prompt_lens=prompt_lens,
        )
