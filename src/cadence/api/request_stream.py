"""One request's bounded buffer, bound to its context: id, deadline, cancellation.

The output reader pushes tokens in as steps arrive; the request's gRPC handler takes
everything that is waiting as one chunk whenever its stream is ready to send. Nothing ever
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
- ``abort``: end the stream with RESOURCE_EXHAUSTED and free its slot, so a client that
  cannot keep up does not hold server memory.

A slow client first fills gRPC's own flow-control window (HTTP/2, at least 64 KiB per stream)
before its writes stop completing; only then do tokens start to wait here.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from cadence.api.metrics import StreamTally
from cadence.api.v1 import inference_pb2 as pb
from cadence.engines.tokenizer import StreamDecoder
from cadence.transport.channel import WorkerLink
from cadence.transport.messages import Finish


class RequestStream:
    """The per-request buffer between the output reader and one gRPC stream."""

    __slots__ = (
        "seq_id", "request_id", "worker", "max_tokens", "include_timing", "received_ns",
        "finish", "error", "overflows", "merged_steps", "_capacity", "_abort_on_overflow", "scheduled_ns",
        "chunks", "_tokens", "_steps", "sent_tokens", "_decode", "_waiter",
        "_start_ns", "_end_ns", "_recv_ns", "_prompt_tokens", "_link", "_block", "_paused",
        "_paused_task", "task", "sending_since_ns", "_texts", "_tally",
    )  # fmt: skip

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        worker: int,
        max_tokens: int,
        prompt_tokens: int,
        *,
        capacity: int,
        overflow: str,
        include_timing: bool,
        decoder: StreamDecoder,
        received_ns: int,
        link: WorkerLink | None = None,
        tally: StreamTally | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.worker = worker
        self.max_tokens = max_tokens
        self.include_timing = include_timing
        self.received_ns = received_ns
        self.finish = Finish.NONE
        self.error: tuple[grpc.StatusCode, str] | None = None
        self.overflows = 0
        """Pushes that found `capacity` steps already waiting."""
        self.merged_steps = 0
        """Steps whose tokens went out in a chunk together with an earlier step's."""
        self._capacity = capacity
        self._abort_on_overflow = overflow == "abort"
        self._block = overflow == "block" and link is not None
        self._paused = False
        """Asked the worker to pause the sequence, and neither resumed it nor ended since."""
        self._paused_task: asyncio.Task | None = None
        """The task watched while paused, to count the pause off if it ends first."""
        self._link = link
        """The worker's link, to pause and resume the sequence under the block policy."""
        self._tally = tally if tally is not None else StreamTally()
        """The front's running totals (its metrics), counted into as things happen."""
        self.task: asyncio.Task | None = None
        """The task serving this stream's RPC (cancelled when its client stalls)."""
        self.sending_since_ns = 0
        """When the chunk being written was handed to gRPC; 0 when no write is pending."""
        self._tokens: list[int] = []
        self._steps = 0
        self.sent_tokens = 0
        """Tokens taken into chunks so far: the next chunk's index."""
        self.chunks = 0
        self._decode = decoder
        self._texts: list[str] = []
        """Text pieces sent by a worker that detokenizes (torch engine), one per waiting token."""
        self._waiter: asyncio.Future[None] | None = None
        self._prompt_tokens = prompt_tokens
        self.scheduled_ns = 0
        self._start_ns = self._end_ns = self._recv_ns = 0

    @property
    def waiting_steps(self) -> int:
        """Steps of output waiting to be sent."""
        return self._steps

    @property
    def done(self) -> bool:
        return self.finish != Finish.NONE or self.error is not None

    def push(self, token: int, start_ns: int, end_ns: int, recv_ns: int) -> None:
        """Add one step's token. Called by the output reader only."""
        if self._steps >= self._capacity:
            self.overflows += 1
            self._tally.overflows += 1
            if self._block:
                if not self._paused:
                    self._pause()
            elif self._abort_on_overflow:
                self.fail(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the client read too slowly: {self._steps} steps of output were waiting "
                    f"(queue capacity {self._capacity}); read faster or ask the operator to "
                    "raise --queue-capacity",
                )
                return
        if not self._tokens:
            self._start_ns, self._end_ns, self._recv_ns = start_ns, end_ns, recv_ns
            if not self.scheduled_ns:
                self.scheduled_ns = start_ns
        self._tokens.append(token)
        self._steps += 1
        self._wake()

    def push_piece(self, tokens: list[int], start_ns: int, end_ns: int, recv_ns: int) -> None:
        """Add an app worker's piece of several tokens; like `push`, it counts as one step."""
        steps = self._steps
        self.push(tokens[0], start_ns, end_ns, recv_ns)
        if self._steps > steps:  # accepted (not refused by the overflow policy)
            self._tokens.extend(tokens[1:])

    def push_text(self, token: int, text: str, start_ns: int, end_ns: int, recv_ns: int) -> None:
        """`push` for a worker that detokenizes: `text` is the token's piece of output text."""
        steps = self._steps
        self.push(token, start_ns, end_ns, recv_ns)
        if self._steps > steps:  # accepted (not refused by the overflow policy)
            self._texts.append(text)

    def _pause(self) -> None:
        self._paused = True
        self._link.pause(self.seq_id)
        self._tally.pauses += 1
        self._tally.paused += 1
        task = self.task
        if task is not None:
            # A client that cancels while paused never reads again, so nothing here would
            # resume it: its task's end takes the pause off the gauge instead.
            self._paused_task = task
            task.add_done_callback(self._task_ended)

    def _unpaused(self) -> None:
        """The pause is over (resumed, or the stream ends): off the gauge, once."""
        self._paused = False
        self._tally.paused -= 1
        task = self._paused_task
        if task is not None:
            self._paused_task = None
            task.remove_done_callback(self._task_ended)

    def _task_ended(self, _task: asyncio.Task) -> None:
        if self._paused:
            self._unpaused()

    def set_prompt_tokens(self, count: int) -> None:
        """The worker tokenized the prompt text and counted `count` tokens."""
        self._prompt_tokens = count

    def end(self, reason: int) -> None:
        """The worker finished the sequence (a Finish value); its last token was pushed already."""
        self.finish = reason
        self._wake()

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """End the stream with a gRPC status; the first failure wins."""
        if not self.done:
            self.error = (code, message)
            if self._paused:
                # Ended with an error, the sequence is aborted, not resumed.
                self._unpaused()
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Return once there is something to send or the stream has ended."""
        if self._tokens or self.done:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    def take_chunk(self) -> pb.GenerateChunk:
        """Everything waiting, as one chunk (the last one carries finish_reason)."""
        tokens = self._tokens
        self._tokens = []
        if self._paused:
            self._unpaused()
            self._link.resume(self.seq_id)
        if self._steps > 1:
            self.merged_steps += self._steps - 1
            self._tally.merged_steps += self._steps - 1
        self._steps = 0
        finish = self.finish
        texts = self._texts
        if texts:  # the worker detokenized these tokens
            self._texts = []
            text = "".join(texts)
        else:
            text = self._decode(tokens, finish != Finish.NONE)
        chunk = pb.GenerateChunk(
            request_id=self.request_id,
            index=self.sent_tokens,
            token_ids=tokens,
            text=text,
            finish_reason=finish,
        )
        if self.sent_tokens == 0:
            chunk.prompt_tokens = self._prompt_tokens
        self.sent_tokens += len(tokens)
        self.chunks += 1
        tally = self._tally
        tally.chunks += 1
        tally.tokens += len(tokens)
        if self.include_timing:
            timing = chunk.timing
            timing.worker = self.worker
            if tokens:
                timing.step_start_ns = self._start_ns
                timing.step_end_ns = self._end_ns
                timing.front_recv_ns = self._recv_ns
            if chunk.index == 0:
                timing.received_ns = self.received_ns
                timing.scheduled_ns = self.scheduled_ns
            timing.send_ns = time.monotonic_ns()
        return chunk

    @property
    def ready(self) -> bool:
        """Something is waiting to be sent."""
        return bool(self._tokens) or self.finish != Finish.NONE
