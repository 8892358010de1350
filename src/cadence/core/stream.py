"""One request's bounded buffer, bound to its context: id, deadline, cancellation.

The output reader pushes tokens in as steps arrive; the request's `Generation` (front.py)
takes everything that is waiting as one chunk whenever its protocol adapter is ready to send. Nothing ever
waits in order to batch: a chunk goes out as soon as the sender is free, and it holds
several tokens only when several were already waiting.

Overflow policy, when more than `capacity` steps' tokens wait (the client reads slower
than the engine writes):
- ``merge`` (default): keep accepting; the waiting tokens go out together as one larger
  chunk. The engine never stalls, no token is lost, memory is bounded by max_tokens.
  Every such overflow is counted.
- ``block``: ask the worker to pause this one sequence (it stays in the batch, keeps its
  cache and is skipped by each step) until the client has read; the rest of the batch never
  waits. A few in-flight steps may still arrive after the pause. Pauses are counted as they
  happen: cadence_sequence_pauses_total, and cadence_paused_sequences for those paused now.
- ``abort``: end the stream with Failure.RESOURCE_EXHAUSTED and free its slot, so a client that
  cannot keep up does not hold server memory.

A slow client first fills gRPC's own flow-control window (HTTP/2, at least 64 KiB per stream)
before its writes stop completing; only then do tokens start to wait here.

One chunk holds at most MAX_CHUNK_BYTES of output, so that no message the front sends is
larger than a default gRPC client accepts (4 MiB): merging stops before a step that would
cross it, and the rest waits for the next chunk. The workers bound each step's piece for one
request below it (cadence.engines.output_text), so every chunk fits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from cadence.byte_tokenizer import StreamDecoder
from cadence.core.metrics import StreamTally
from cadence.core.requests import Chunk, ChunkTiming
from cadence.transport.front_channel import WorkerLink
from cadence.vocabulary import Failure, Finish

MAX_CHUNK_BYTES = 3 << 20
"""Bytes of output one chunk may hold (3 MiB), counted as its text's UTF-8 bytes plus
TOKEN_ID_BYTES per token id: under the 4 MiB a default gRPC client accepts in one message,
with room for the message's other fields. A KServe response (4 bytes per id) and an OpenAI
event (the text alone, JSON-escaped) are built from one chunk too."""

TOKEN_ID_BYTES = 5
"""The most bytes one token id takes in a message: a non-negative int32 as a protobuf varint."""

_FRONT_DECODED_BYTES = 3
"""The most UTF-8 bytes the front's byte decoder gives per token (U+FFFD for an invalid byte)."""


class RequestStream:
    """The per-request buffer between the output reader and one request's `Generation`."""

    __slots__ = (
        "_abort_on_overflow",
        "_block",
        "_capacity",
        "_cpu_wait_ns",
        "_decode",
        "_end_ns",
        "_ends",
        "_link",
        "_paused",
        "_paused_task",
        "_prompt_tokens",
        "_recv_ns",
        "_start_ns",
        "_steps",
        "_tally",
        "_texts",
        "_tokens",
        "_waiter",
        "cached_tokens",
        "counts_pieces",
        "deliver",
        "end_call",
        "error",
        "finish",
        "first_token_ns",
        "handoff_ns",
        "include_timing",
        "prefill_worker",
        "received_ns",
        "scheduled_ns",
        "sending_since_ns",
        "sent_tokens",
        "seq_id",
        "task",
        "worker",
    )

    def __init__(
        self,
        seq_id: int,
        worker: int,
        prompt_tokens: int,
        *,
        capacity: int,
        overflow: str,
        include_timing: bool,
        decoder: StreamDecoder,
        received_ns: int,
        tally: StreamTally,
        link: WorkerLink | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.worker = worker
        self.include_timing = include_timing
        self.received_ns = received_ns
        self.finish: int = Finish.NONE
        """A Finish value, as the worker's message carries it (Chunk.finish is an int too)."""
        self.error: tuple[Failure, str] | None = None
        self._capacity = capacity
        self._abort_on_overflow = overflow == "abort"
        self._block = overflow == "block" and link is not None
        self._paused = False
        """Asked the worker to pause the sequence, and neither resumed it nor ended since."""
        self._paused_task: asyncio.Task | None = None
        """The task watched while paused, to count the pause off if it ends first."""
        self._link = link
        """The worker's link, to pause and resume the sequence under the block policy."""
        self._tally = tally
        """The front's running totals (its metrics), counted into as things happen."""
        self.task: asyncio.Task | None = None
        """The task serving this stream's call (cancelled when its client stalls)."""
        self.end_call: Callable[[Failure, str], Awaitable[None]] | None = None
        """`FrontCore.open`'s `end_call`, from an adapter whose call, once its task is
        cancelled, must still be ended with a status (grpc.aio ends a cancelled handler's call
        with none, so a client that reads again would wait for its deadline): the stall
        sweep awaits it after the cancel."""
        self.sending_since_ns = 0
        """When the chunk being written was handed to the adapter; 0 when no write is pending."""
        self._tokens: list[int] = []
        self._steps = 0
        self.sent_tokens = 0
        """Positions taken into chunks so far: the next chunk's index. A position is a token,
        or one piece of text of a model's (`counts_pieces`)."""
        self.counts_pieces = False
        """Each piece pushed is one position whatever its tokens: a batched model's text
        pieces (the output reader sets it from the step). Such pieces always come with text."""
        self._decode = decoder
        self._texts: list[str] = []
        """Text pieces sent by a worker that detokenizes (torch engine), one per waiting step."""
        self._ends: list[int] = []
        """With `_texts`: how many of `_tokens` the steps up to each text brought, so that a
        chunk over MAX_CHUNK_BYTES can end at a step's end."""
        self._waiter: asyncio.Future[None] | None = None
        self.deliver: Callable[[], None] | None = None
        """Set while the output reader writes for the adapter (`Generation.write_from_reader`):
        the output reader calls it once per step that brought output or the end, after the
        whole step, in place of waking the adapter's task. A failure still wakes the task."""
        self._prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        """Prompt tokens the worker's prefix cache served (set with the first token)."""
        self.scheduled_ns = 0
        self.first_token_ns = 0
        """When the step that made the first token ended."""
        self._start_ns = self._end_ns = self._recv_ns = 0
        self._cpu_wait_ns = -1
        self.prefill_worker = -1
        """Disaggregated serving: the worker that prefilled the sequence before it was handed
        to `worker` (-1: none, the sequence runs where it started)."""
        self.handoff_ns = 0
        """When the front got the sequence's state from its prefill worker (0: never)."""

    @property
    def waiting_steps(self) -> int:
        """Steps of output waiting to be sent."""
        return self._steps

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens

    @property
    def done(self) -> bool:
        return self.finish != Finish.NONE or self.error is not None

    def push(
        self,
        tokens: int | list[int],
        text: str | None,
        start_ns: int,
        end_ns: int,
        recv_ns: int,
        cpu_wait_ns: int = -1,
    ) -> None:
        """Add one step's piece of output: its token, or its tokens (copied: the caller may
        reuse the list), and their text when the worker detokenizes (None: the front decodes
        them); the step's times and its threads' wait for a CPU (-1: not measured). Called by
        the output reader only."""
        if self._steps >= self._capacity:
            self._tally.overflows += 1
            if self._block:
                if not self._paused:
                    self._pause()
            elif self._abort_on_overflow:
                self.fail(
                    Failure.RESOURCE_EXHAUSTED,
                    f"the client read too slowly: {self._steps} steps of output were waiting "
                    f"(queue capacity {self._capacity}); read faster or ask the operator to "
                    "raise --queue-capacity",
                )
                return
        if not self._tokens:
            self._start_ns, self._end_ns, self._recv_ns = start_ns, end_ns, recv_ns
            self._cpu_wait_ns = cpu_wait_ns
            if not self.scheduled_ns:
                self.scheduled_ns, self.first_token_ns = start_ns, end_ns
        if type(tokens) is int:  # a piece of one token, as a batching engine sends
            self._tokens.append(tokens)
        else:
            # A list: `type() is int` (cheaper per token than an isinstance, which would
            # narrow) leaves mypy the union.
            self._tokens += tokens  # type: ignore[arg-type]  # a list[int] here, see above
        if text is not None:
            self._texts.append(text)
            self._ends.append(len(self._tokens))
        self._steps += 1
        if self.deliver is None:
            self.wake()

    def _pause(self) -> None:
        link = self._link
        assert link is not None  # `_block` (the one caller's condition) needs a link
        self._paused = True
        link.pause(self.seq_id)
        self._tally.pauses += 1
        self._tally.paused += 1
        task = self.task
        if task is not None:
            # A client that cancels while paused never reads again, so nothing here would
            # resume it: its task's end takes the pause off the gauge instead.
            self._paused_task = task
            task.add_done_callback(self._task_ended)

    def _unpaused(self) -> WorkerLink:
        """The pause is over (resumed, or the stream ends): off the gauge, once. Returns the
        worker's link (to resume the sequence with)."""
        link = self._link
        assert link is not None  # paused only by `_pause`, which had one
        self._paused = False
        self._tally.paused -= 1
        link.paused -= 1
        task = self._paused_task
        if task is not None:
            self._paused_task = None
            task.remove_done_callback(self._task_ended)
        return link

    def handed_off(self, worker: int, link: WorkerLink, prefill_worker: int, at_ns: int) -> None:
        """The sequence goes on on another worker (disaggregated serving: the front got its
        state from `prefill_worker` at `at_ns`): aborts, pauses and a worker's death concern
        that one from now on. A pause ends here (the worker that had it no longer holds the
        sequence); the next overflow pauses it anew."""
        self.prefill_worker = prefill_worker
        self.handoff_ns = at_ns
        if self._paused:
            self._unpaused()
        self.worker = worker
        self._link = link

    def _task_ended(self, _task: asyncio.Task) -> None:
        if self._paused:
            self._unpaused()

    def set_prompt_tokens(self, count: int) -> None:
        """The worker tokenized the prompt text and counted `count` tokens."""
        self._prompt_tokens = count

    def end(self, reason: int) -> None:
        """The worker finished the sequence (a Finish value); its last token was pushed already."""
        self.finish = reason
        if self.deliver is None:
            self.wake()

    def fail(self, failure: Failure, message: str) -> None:
        """End the stream with a failure; the first one wins."""
        if not self.done:
            self.error = (failure, message)
            if self._paused:
                # Ended with an error, the sequence is aborted, not resumed.
                self._unpaused()
            self.wake()

    def flush(self) -> None:
        """This step's output is all in: hand it to `deliver` (the output reader calls this,
        once per step, for a stream that has `deliver`)."""
        deliver = self.deliver
        if deliver is None:
            self.wake()
            return
        try:
            deliver()
        except Exception:
            self.deliver = None
            self.wake()  # the adapter's task takes over, and meets the error itself

    def wake(self) -> None:
        """End a pending `wait` (output came, the stream ended, or the intake lulled)."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Return once there is something to send or the stream has ended."""
        if self._tokens or self.done:
            return
        await self.waiter()

    def waiter(self) -> asyncio.Future[None]:
        """A future that `wake` completes: awaited directly, it costs no coroutine."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        return waiter

    def take_chunk(self) -> Chunk:
        """Everything waiting, as one chunk (the last one carries its finish), or as much of
        it as MAX_CHUNK_BYTES allows: the rest stays waiting, for the next chunk."""
        tokens = self._tokens
        texts = self._texts
        steps = self._steps
        whole = True
        if texts:  # the worker detokenized these tokens
            text = "".join(texts)
            if TOKEN_ID_BYTES * len(tokens) + 4 * len(text) > MAX_CHUNK_BYTES:  # may be over
                steps, tokens, text = self._fitting_steps(text)
                whole = steps == self._steps
        elif len(tokens) * (TOKEN_ID_BYTES + _FRONT_DECODED_BYTES) > MAX_CHUNK_BYTES:
            # Where its steps began is not kept: the rest counts as one step, or as those left.
            tokens = tokens[: MAX_CHUNK_BYTES // (TOKEN_ID_BYTES + _FRONT_DECODED_BYTES)]
            steps = max(self._steps - 1, 1)
            whole = False
        if whole:
            self._tokens = []
            self._texts = []
            self._ends = []
            self._steps = 0
            finish = self.finish
        else:
            self._tokens = self._tokens[len(tokens) :]
            self._steps = max(self._steps - steps, 1)
            finish = Finish.NONE
        if self._paused:
            self._unpaused().resume(self.seq_id)
        tally = self._tally
        if steps > 1:
            tally.merged_steps += steps - 1
        if not texts:
            text = self._decode(tokens, finish != Finish.NONE)
            positions = len(tokens)
        else:
            # The pieces taken: all of `texts` when whole, else the first `steps`.
            positions = (len(texts) if whole else steps) if self.counts_pieces else len(tokens)
        index = self.sent_tokens
        timing = None
        if self.include_timing:
            timing = ChunkTiming(worker=self.worker)
            if self.handoff_ns:  # disaggregated: handed from its prefill worker
                timing.prefill_worker = self.prefill_worker
                timing.handoff_ns = self.handoff_ns
                if tokens and self._recv_ns < self.handoff_ns:  # the prefill worker's token
                    timing.worker = self.prefill_worker
            if tokens:
                timing.step_start_ns = self._start_ns
                timing.step_end_ns = self._end_ns
                timing.front_recv_ns = self._recv_ns
                timing.step_cpu_wait_ns = self._cpu_wait_ns
            if index == 0:
                timing.received_ns = self.received_ns
                timing.scheduled_ns = self.scheduled_ns
        chunk = Chunk(
            index,
            tokens,
            text,
            finish,
            self._prompt_tokens if index == 0 else 0,
            timing,
            self.cached_tokens,
            positions if positions != len(tokens) else 0,
        )
        self.sent_tokens = index + positions
        tally.chunks += 1
        tally.tokens += positions
        return chunk

    def _fitting_steps(self, text: str) -> tuple[int, list[int], str]:
        """The waiting steps (how many, their tokens, their text) that fit in one chunk, at
        least one; those that do not stay in `_texts` and `_ends`. Only when `text`, all the
        waiting steps' text, may not fit."""
        texts, ends = self._texts, self._ends
        size = 0
        taken = 0
        for i, piece in enumerate(texts):
            size += len(piece.encode("utf-8", "surrogatepass")) + TOKEN_ID_BYTES * (
                ends[i] - (ends[i - 1] if i else 0)
            )
            if size > MAX_CHUNK_BYTES and i:
                break
            taken = i + 1
        if taken == len(texts):
            return self._steps, self._tokens, text
        count = ends[taken - 1]
        self._texts = texts[taken:]
        self._ends = [end - count for end in ends[taken:]]
        return taken, self._tokens[:count], "".join(texts[:taken])
