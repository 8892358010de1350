"""A model written as `generate_stream(batch)` (one generator per batch) served as a step.

    class MyModel:
        def generate_stream(self, batch: list[Sequence]) -> Iterator[list[int | str | None]]:
            ...   # each yield: one output per sequence of `batch`, None once one is done

This is the batch-generator loop (`batch = get_batch(); for outputs in
model.generate_stream(batch): put(outputs)`) on cadence's batching loop. `BatchGenerator`
gives such a model the `step` / `release` / `reserve` of a step model: waiting requests are
gathered into a batch (up to max_batch, for at most the batch timeout after the first one
arrives, through `reserve`), each step takes the generator's next outputs, and no sequence
joins a running batch: a request that arrives while one runs waits until every sequence of
that batch has finished or been released. That wait is what this shape costs against `step`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from cadence.engines.base import Sequence
from cadence.wording import counted


class BatchGenerator:
    """One running `generate_stream` generator at a time, stepped one yield per step."""

    def __init__(
        self,
        generate_stream: Callable[[list[Sequence]], Iterator[list]],
        label: str,
        max_batch: int,
        batch_timeout_s: float,
        release: Callable[[Sequence], None] | None,
    ) -> None:
        self._generate = generate_stream
        self._label = label
        self._max_batch = max_batch
        self._timeout_s = batch_timeout_s
        self._model_release = release
        self._stream: Iterator[list] | None = None
        self._positions: dict[int, int] = {}
        """Each live sequence of the running batch: its position in the generator's outputs."""
        self._behind: dict[int, deque] = {}
        """Outputs of sequences left out of steps (paused: their client is not reading), kept
        for them in order."""
        self._arrived = 0
        """Requests checked in since the running batch started (an upper bound of those waiting)."""
        self._gathering_since: float | None = None
        self._forming = False
        """The gathering is over: admit every waiting sequence until the batch starts."""
        self._failed: str | None = None

    def arrived(self) -> None:
        """A request was accepted into the scheduler's queue."""
        self._arrived += 1

    def reserve(self, seq: Sequence) -> bool:
        """Admit sequences only into a new batch, once gathering is over."""
        if self._stream is not None:
            return False  # a batch runs: no joining it
        if self._forming:
            return True
        now = time.monotonic()
        if self._gathering_since is None:
            self._gathering_since = now
        if self._arrived < self._max_batch and now - self._gathering_since < self._timeout_s:
            return False
        self._forming = True
        return True

    def step(self, prefill: list[Sequence], decode: list[Sequence]) -> list[int | str | None]:
        if prefill:  # only ever into a new batch: every sequence of it, in one step
            self._stream = iter(self._generate(prefill))
            self._positions = {seq.seq_id: i for i, seq in enumerate(prefill)}
            self._forming, self._gathering_since, self._arrived = False, None, 0
            self._failed = None
        if self._failed is not None:
            raise RuntimeError(self._failed)
        try:
            assert self._stream is not None  # set by a prefill; decodes are of its batch
            outputs = next(self._stream)
        except StopIteration:  # the generator ended: every sequence still in it is done
            outputs = [None] * (max(self._positions.values(), default=-1) + 1)
        except Exception as exc:
            self._failed = f"the batch's generator raised earlier: {type(exc).__name__}: {exc}"
            raise
        outputs = list(outputs)
        positions = self._positions
        if len(outputs) <= max(positions.values(), default=-1):
            raise ValueError(
                f"{self._label}.generate_stream yielded "
                f"{counted(len(outputs), 'output')} for a batch of "
                f"{counted(len(prefill) or len(positions), 'sequence')}; yield one "
                "per sequence"
            )
        behind = self._behind
        stepped = prefill + decode
        if behind or len(stepped) < len(positions):
            return self._in_order(stepped, outputs)
        return [outputs[positions[seq.seq_id]] for seq in stepped]

    def _in_order(self, stepped: list[Sequence], outputs: list) -> list:
        """Outputs when some sequences of the batch were left out of steps: theirs wait."""
        behind = self._behind
        stepped_ids = {seq.seq_id for seq in stepped}
        for seq_id, position in self._positions.items():
            if seq_id not in stepped_ids:
                behind.setdefault(seq_id, deque()).append(outputs[position])
        result = []
        for seq in stepped:
            output = outputs[self._positions[seq.seq_id]]
            waiting = behind.get(seq.seq_id)
            if waiting:
                waiting.append(output)
                output = waiting.popleft()
            result.append(output)
        return result

    def release(self, seq: Sequence) -> None:
        if self._positions.pop(seq.seq_id, None) is not None:
            self._behind.pop(seq.seq_id, None)
            if not self._positions:  # the batch is over: the next one may start
                stream, self._stream = self._stream, None
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
        if self._model_release is not None:
            self._model_release(seq)
