"""Continuous batching: new sequences join at step boundaries, each step emits one token per sequence."""

from __future__ import annotations

import time
from collections import deque

from cadence.engines.base import Engine, Sequence
from cadence.transport.messages import AddRequest, Finish, RequestFailed, StepOutput


class BatchScheduler:
    """Owns a worker's waiting queue and running batch, and turns one engine step into one message."""

    def __init__(self, engine: Engine, worker: int, max_batch: int) -> None:
        self._engine = engine
        self._worker = worker
        self._max_batch = max_batch
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}
        self._steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def batch_size(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def add(self, request: AddRequest) -> RequestFailed | None:
        """Queue a request for the next step boundary, or say why the engine cannot run it."""
        problem = self._engine.check(request)
        if problem is not None:
            return RequestFailed(request.seq_id, "INVALID_ARGUMENT", problem)
        self._waiting.append(Sequence(request))
        return None

    def abort(self, seq_ids: list[int]) -> None:
        """Drop sequences now, so none of them is in the next step."""
        for seq_id in seq_ids:
            seq = self._running.pop(seq_id, None)
            if seq is not None:
                self._engine.release(seq)
        if seq_ids and self._waiting:
            gone = set(seq_ids)
            self._waiting = deque(s for s in self._waiting if s.seq_id not in gone)

    def step(self) -> StepOutput | None:
        """Admit waiting sequences, run one engine step, retire finished sequences.

        This is the only place in the worker that loops over a step's tokens.
        """
        room = self._max_batch - len(self._running)
        prefill = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        decode = list(self._running.values())
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
        for seq in prefill:
            running[seq.seq_id] = seq
        for seq, token in zip(prefill + decode, tokens):
            seq.generated += 1
            seq_ids.append(seq.seq_id)
            if token in seq.stop_token_ids:
                reason = Finish.STOP
            elif seq.generated >= seq.request.max_tokens:
                reason = Finish.LENGTH
            else:
                continue
            finished.append(seq.seq_id)
            reasons.append(reason)
            del running[seq.seq_id]
            self._engine.release(seq)
        return StepOutput(self._worker, self._steps, start, end, seq_ids, tokens, finished, reasons)
