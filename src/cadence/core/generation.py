"""The stages every protocol shares, from a checked request to its last chunk.

`FrontCore.open` validates a `Request` into the worker's `AddRequest`, admits it
(router/admission.py), routes it (router/worker_router.py), registers its `RequestStream`
(stream.py) and sends it to its worker, with a deadline timer. It returns a `Generation`: the
one async iterator per request, which yields domain `Chunk`s as the output reader
(output_reader.py) fills the stream, records TTFT / ITL / queue wait for every protocol, and,
when closed however the request ended, gives back everything the request held. Protocol
adapters (cadence.api.*) map their wire to a `Request` and each `Chunk` to their wire, and
nothing else; failures arrive as `RequestError`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Self

import msgspec

from cadence.byte_tokenizer import ByteTokenizer
from cadence.config import ServerConfig
from cadence.core.errors import InvalidRequest, RequestError
from cadence.core.handoff import HandOffs
from cadence.core.intake_lull import IntakeLull
from cadence.core.metrics import FrontMetrics, ProtocolMetrics
from cadence.core.requests import (
    PRIORITY_RANGE,
    REQUEST_ID_MAX_BYTES,
    SEED_RANGE,
    TOKEN_ID_MAX,
    TOP_K_MAX,
    Chunk,
    Request,
)
from cadence.core.stream import RequestStream
from cadence.core.tracing import RequestTracer
from cadence.router import WorkerRouter
from cadence.router.admission import AdmissionGate, SharedAdmissionGate
from cadence.router.prefix_index import prompt_hashes
from cadence.router.worker_router import NoWorkerAvailable
from cadence.transport.front_channel import WorkerLink, encode_add
from cadence.vocabulary import AddRequest, Failure, Finish, prompt_over_limit


def sequence_ids(front: int, fronts: int, generation: int = 0) -> Iterator[int]:
    """A front's sequence ids: with `--fronts N` front k's are k (mod N), so a worker knows
    whose each is (one front: 1, 2, 3, ...); a restarted front (`generation` > 0) starts far
    past its predecessors, so no id of theirs comes back."""
    return itertools.count(fronts * (1 + (generation << 32)) + front, fronts)


class FrontCore:
    """The protocol-agnostic front: one per front process, shared by every adapter."""

    def __init__(
        self,
        config: ServerConfig,
        links: list[WorkerLink],
        router: WorkerRouter,
        metrics: FrontMetrics,
        *,
        gate: AdmissionGate | SharedAdmissionGate | None = None,
        seq_ids: Iterator[int] | None = None,
    ) -> None:
        self._config = config
        self._links = links
        self._router = router
        self._gate = gate or AdmissionGate(config.max_concurrent)
        self._seq_ids = seq_ids or sequence_ids(0, 1)
        self._tokenizer = ByteTokenizer()
        self._text_to_worker = config.engine.tokenizes_text
        """The worker tokenizes text prompts with the model's own tokenizer."""
        self._text_beside_bytes = config.engine.text_beside_bytes
        """The worker gets a text prompt's bytes and its text (an app's own tokenizer)."""
        self.streams: dict[int, RequestStream] = {}
        """The open requests' streams by sequence id (the output reader's index)."""
        self._ending: set[asyncio.Future] = set()
        """Calls of cut-off streams being ended with their status (`RequestStream.end_call`)."""
        self._request_ids: set[str] = set()
        """Client-chosen request ids of the open streams that must be unique."""
        self.metrics = metrics
        metrics.watch(
            active=lambda: self._gate.active,
            deepest_buffer=lambda: max((s.waiting_steps for s in self.streams.values()), default=0),
        )
        self.refusal: str | None = "the server is starting; retry shortly"
        """Why new requests are refused (start-up, drain), or None while serving."""
        self._lull = IntakeLull()
        self.handoffs: HandOffs | None = None
        """Disaggregated serving (`--prefill-devices`): the sequences between a prefill and a
        decode worker; None: every request runs where it starts."""
        if config.disaggregated:
            prefill = len(config.prefill_devices)
            self.handoffs = HandOffs(
                links,
                router,
                self.streams,
                range(prefill),
                range(prefill, len(config.devices)),
                config.handoff_window,
            )
            self.handoffs.on_handoff = metrics.handoffs.inc
            metrics.watch_handoffs(config.roles, self.handoffs.waiting, self.handoffs.in_flight)
        self.tracer: RequestTracer | None = None
        """Exports a span per finished request (`--otlp-traces-endpoint`), or None."""

    def requests_waiting(self) -> int:
        """Open requests no worker has taken into a step yet (read when scraped)."""
        return sum(1 for s in self.streams.values() if not s.scheduled_ns)

    def requests_running(self) -> int:
        """Open requests in the workers' steps (read when scraped)."""
        return len(self.streams) - self.requests_waiting()

    @property
    def active(self) -> int:
        """Requests admitted and not yet closed."""
        return self._gate.active

    def refused(self, failure: Failure, protocol: str) -> None:
        """Count a request that ended before it started (an adapter's own refusals too);
        `protocol`: the adapter's (metrics.PROTOCOLS)."""
        self.metrics.requests.labels(failure.name, protocol).inc()

    def open(
        self,
        request: Request,
        received_ns: int,
        time_remaining: Callable[[], float | None],
        *,
        protocol: str,
        unique_id: bool = True,
        task: asyncio.Task | None = None,
        end_call: Callable[[Failure, str], Awaitable[None]] | None = None,
        operation: str = "text_completion",
    ) -> Generation:
        """Check, admit, route and start one request; raise RequestError if it cannot start.

        Close the result however the request ends (`with generation:`). `time_remaining`
        gives the seconds left before the call's deadline (None: no deadline); `protocol`
        labels the request's metrics (metrics.PROTOCOLS); with
        `unique_id` a `request_id` that an open request holds is refused; `task` is
        cancelled if the client stops reading (default: the current one); `end_call`, for
        a call that a cancelled task leaves without a status (grpc.aio's), ends it with the
        failure's once the stall sweep cut it off (`RequestStream.end_call`); `operation` is
        the request's `gen_ai.operation.name` in traces (`text_completion` or `chat`).
        """
        self._lull.opened += 1
        config = self._config
        try:
            if self.refusal is not None:
                raise RequestError(Failure.UNAVAILABLE, self.refusal)
            add = self._validate(next(self._seq_ids), request)
            request_id = request.request_id
            if unique_id and request_id in self._request_ids:
                raise InvalidRequest(
                    f"request_id {request_id!r} is already streaming; use a unique id "
                    "or leave it empty for the server to assign one"
                )
            remaining = time_remaining()
            if remaining is not None:
                # The worker learns the deadline too, so an app function can see it.
                add = msgspec.structs.replace(add, timeout_ms=max(remaining * 1e3, 0.001))
            try:
                frame = encode_add(add)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
            if not self._gate.try_enter():
                raise RequestError(
                    Failure.RESOURCE_EXHAUSTED,
                    f"the server is serving its limit of {self._gate.limit} streams "
                    "(--max-concurrent); retry later",
                )
            try:
                router = self._router
                prefixes = router.prefixes
                pool = None
                handoffs = self.handoffs
                if handoffs is not None:
                    length = len(add.prompt_token_ids) or len(add.prompt_text)
                    long = length > config.disaggregate_above
                    pool = handoffs.prefill if long else handoffs.decode
                worker = router.pick(
                    None
                    if prefixes is None
                    else prompt_hashes(add.prompt_token_ids, add.prompt_text, prefixes.capacity),
                    pool,
                )
            except NoWorkerAvailable:
                self._gate.leave()
                raise RequestError(
                    Failure.UNAVAILABLE, "no worker is running on this server"
                ) from None
        except RequestError as exc:
            self.refused(exc.failure, protocol)
            raise

        link = self._links[worker]
        stream = RequestStream(
            add.seq_id,
            worker,
            len(add.prompt_token_ids),
            capacity=config.queue_capacity,
            overflow=config.overflow,
            include_timing=request.include_timing,
            decoder=self._tokenizer.stream_decoder(),
            received_ns=received_ns,
            tally=self.metrics.tally,
            link=link,
        )
        stream.task = task or asyncio.current_task()
        stream.end_call = end_call
        self.streams[add.seq_id] = stream
        held_id = request_id if unique_id and request_id else None
        if held_id is not None:
            self._request_ids.add(held_id)
        deadline = None
        if remaining is not None:
            deadline = asyncio.get_running_loop().call_later(
                max(remaining, 0.0),
                stream.fail,
                Failure.DEADLINE_EXCEEDED,
                "the request's deadline passed before generation finished",
            )
        self._router.assign(worker, add.max_tokens)
        if pool is not None and handoffs is not None and pool is handoffs.prefill:
            handoffs.expect(add.seq_id, frame, add.max_tokens)
        link.add(frame)
        return Generation(
            self,
            stream,
            request,
            operation,
            request_id or uuid.uuid4().hex,
            add.max_tokens,
            held_id,
            deadline,
            time_remaining if remaining is not None else None,
            self.metrics.for_protocol(protocol),
        )

    async def intake_lull(self, generation: Generation) -> None:
        """Return at the next lull in the intake of new requests (a moment in which none
        opened), or sooner once `generation` has output or has ended: where an adapter's
        per-call work that need not come first is cheapest (see intake_lull.py)."""
        await self._lull.wait(generation.stream)

    def _validate(self, seq_id: int, request: Request) -> AddRequest:
        """Check a request and turn it into the worker's message, or raise InvalidRequest."""
        config = self._config
        if (size := len(request.request_id.encode())) > REQUEST_ID_MAX_BYTES:
            raise InvalidRequest(
                f"request_id is {size} bytes long; at most "
                f"{REQUEST_ID_MAX_BYTES} are accepted (it is echoed on every "
                "response)",
                "request_id",
            )
        if request.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        if request.max_tokens > config.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens is {request.max_tokens}; this server allows at most "
                f"{config.max_tokens_limit} (--max-tokens-limit)",
                "max_tokens",
            )
        prompt_text = ""
        if request.prompt_token_ids:
            prompt = request.prompt_token_ids
            if min(prompt) < 0:
                raise InvalidRequest("prompt_token_ids must not be negative", "prompt_token_ids")
            if max(prompt) > TOKEN_ID_MAX:
                raise InvalidRequest(
                    f"prompt_token_ids must be at most {TOKEN_ID_MAX}", "prompt_token_ids"
                )
        elif request.prompt and self._text_to_worker:
            # Tokenized, counted and checked against the model's context by the worker.
            prompt, prompt_text = [], request.prompt
        elif request.prompt:
            prompt = self._tokenizer.encode(request.prompt)
            if self._text_beside_bytes:
                prompt_text = request.prompt
        else:
            raise InvalidRequest("the prompt is empty: set prompt or prompt_token_ids", "prompt")
        refusal = prompt_over_limit(len(prompt), config.max_prompt_tokens)
        if refusal is not None:
            raise InvalidRequest(refusal, "prompt")
        sampling = request.sampling
        if not sampling.temperature >= 0 or math.isinf(sampling.temperature):
            raise InvalidRequest(
                "sampling.temperature must be a finite number, 0 (greedy) or more",
                "sampling.temperature",
            )
        if not 0 <= sampling.top_p <= 1:
            raise InvalidRequest("sampling.top_p must be between 0 and 1", "sampling.top_p")
        # Every integer in range here, whatever the protocol: the worker's message holds 64 bits.
        if not 0 <= sampling.top_k <= TOP_K_MAX:
            raise InvalidRequest(f"sampling.top_k must be from 0 to {TOP_K_MAX}", "sampling.top_k")
        if not SEED_RANGE[0] <= sampling.seed <= SEED_RANGE[1]:
            raise InvalidRequest(
                f"sampling.seed must be from {SEED_RANGE[0]} to {SEED_RANGE[1]}", "sampling.seed"
            )
        stops = sampling.stop_token_ids
        if stops and (min(stops) < 0 or max(stops) > TOKEN_ID_MAX):
            raise InvalidRequest(
                f"stop_token_ids must be from 0 to {TOKEN_ID_MAX}", "sampling.stop_token_ids"
            )
        if not PRIORITY_RANGE[0] <= request.priority <= PRIORITY_RANGE[1]:
            raise InvalidRequest(
                f"priority must be from {PRIORITY_RANGE[0]} to "
                f"{PRIORITY_RANGE[1]} (lower is served first)",
                "priority",
            )
        return AddRequest(
            seq_id,
            prompt,
            request.max_tokens,
            sampling,
            prompt_text=prompt_text,
            priority=request.priority,
        )

    def release(self, generation: Generation) -> None:
        """Give back what a request held (see `Generation.close`) and record how it ended."""
        stream = generation.stream
        if generation.deadline is not None:
            generation.deadline.cancel()
        del self.streams[stream.seq_id]
        if generation.held_id is not None:
            self._request_ids.discard(generation.held_id)
        worker = stream.worker
        self._router.release(worker, generation.max_tokens)
        self._gate.leave()
        if self.handoffs is not None:
            self.handoffs.ended(stream.seq_id, worker)
        if stream.finish in (Finish.NONE, Finish.CANCELLED):
            # Cancelled, past its deadline, failed or drained: the worker drops it at its
            # next step.
            self._links[worker].abort(stream.seq_id)
        failure = generation.failure
        by_protocol = generation.protocol_metrics
        self.metrics.requests.labels(
            failure.name if failure is not None else "OK", by_protocol.protocol
        ).inc()
        by_protocol.e2e.observe((time.monotonic_ns() - stream.received_ns) / 1e9)
        if self.tracer is not None:
            self.tracer.record(generation)

    def fail_worker(self, worker: int, message: str) -> None:
        """Worker `worker` stopped: end its streams at once (the others go on)."""
        if self.handoffs is not None:
            self.handoffs.worker_down(worker)
        for stream in list(self.streams.values()):
            if stream.worker == worker:
                stream.fail(Failure.UNAVAILABLE, message)

    def fail_all(self, failure: Failure, message: str) -> None:
        for stream in list(self.streams.values()):
            stream.fail(failure, message)

    async def sweep_stalled(self, stall_timeout_s: float) -> None:
        """Forever: cut off streams whose client has read nothing for `stall_timeout_s`.

        A write that has not completed for that long means the client's flow-control
        window is full and it is not reading; its task is cancelled and its slot freed.
        """
        limit_ns = int(stall_timeout_s * 1e9)
        cut = (
            Failure.RESOURCE_EXHAUSTED,
            f"the client read nothing for {stall_timeout_s:g} s (--stall-timeout)",
        )
        while True:
            await asyncio.sleep(min(1.0, stall_timeout_s / 4))
            now = time.monotonic_ns()
            for stream in list(self.streams.values()):
                since = stream.sending_since_ns
                if since and now - since > limit_ns and stream.task is not None:
                    stream.fail(*cut)
                    # Once: the task may take a moment to end its call (HTTP writes the
                    # error event first) and must not be cancelled again meanwhile.
                    stream.task.cancel()
                    stream.task = None
                    if stream.end_call is not None:
                        end, stream.end_call = stream.end_call, None
                        self._ending.add(task := asyncio.ensure_future(end(*cut)))
                        task.add_done_callback(self._ending.discard)


class Generation:
    """One started request: an async iterator of its chunks, then `close` (or a `with` block).

    Each chunk is handed to the adapter as soon as there is one: everything waiting, merged
    (stream.py). The iterator records TTFT (first chunk), queue wait and ITL (per token of a
    later chunk) on the front's clock; it ends after the chunk that carries the finish, once
    the adapter asks for the next (so the last write completed), or raises RequestError when
    the stream failed. Closing, however the request ended (finished, failed, client cancel,
    deadline, drain), gives back the deadline timer, its place in the streams, the router's
    work and the admission slot, aborts in the worker a sequence it has not finished, and
    records the outcome.
    """

    __slots__ = (
        "_core",
        "_ended",
        "_last_ns",
        "_write",
        "_write_error",
        "deadline",
        "failure",
        "first_send_ns",
        "held_id",
        "max_tokens",
        "operation",
        "protocol_metrics",
        "request",
        "request_id",
        "stream",
        "time_remaining",
    )

    def __init__(
        self,
        core: FrontCore,
        stream: RequestStream,
        request: Request,
        operation: str,
        request_id: str,
        max_tokens: int,
        held_id: str | None,
        deadline: asyncio.TimerHandle | None,
        time_remaining: Callable[[], float | None] | None,
        protocol_metrics: ProtocolMetrics,
    ) -> None:
        self._core = core
        self.protocol_metrics = protocol_metrics
        """Where this request's TTFT, queue wait, ITL and duration go: its protocol's series."""
        self.stream = stream
        self.request = request
        """What the client asked for, as its adapter read it."""
        self.operation = operation
        """The request's `gen_ai.operation.name` in traces."""
        self.request_id = request_id
        """The client's id, or the one the server assigned."""
        self.max_tokens = max_tokens
        self.held_id = held_id
        """The client's id held in the core's set of unique ids, or None."""
        self.deadline = deadline
        self.time_remaining = time_remaining
        """The call's deadline (seconds left), or None when it has none."""
        self.failure: Failure | None = Failure.CANCELLED
        """How the request ended: None once its last chunk was taken and sent (OK)."""
        self._last_ns = 0
        self.first_send_ns = 0
        """When the first chunk was handed to the adapter; 0 until then."""
        self._ended = False
        """The chunk with the finish was handed out."""
        self._write: Callable[[Chunk], bool] | None = None
        """The adapter's writer while the output reader writes for it (`write_from_reader`)."""
        self._write_error: Exception | None = None
        """What `_write` raised in the output reader, for the adapter's task to meet."""

    @property
    def received_ns(self) -> int:
        return self.stream.received_ns

    @property
    def scheduled_ns(self) -> int:
        """When a worker took the request (its first step began); 0 until then."""
        return self.stream.scheduled_ns

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Chunk:
        waiter = self.ready()
        if waiter is not None:
            await waiter
        chunk = self.take()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    def ready(self) -> asyncio.Future[None] | None:
        """The adapter asks for the next chunk (so its last write completed): None when
        `take` has one (or the end) now, else a future done once it has. With `take`, the
        iterator without a coroutine per chunk, for an adapter whose writes seldom wait."""
        stream = self.stream
        stream.sending_since_ns = 0
        if self._ended or stream.waiting_steps or stream.done:
            return None
        return stream.waiter()

    @property
    def error(self) -> tuple[Failure, str] | None:
        """The failure the stream ended with and its message, or None (not failed)."""
        return self.stream.error

    async def write_from_reader(self, write: Callable[[Chunk], bool]) -> None:
        """The chunk last taken is written: until the adapter has to act, the output reader
        takes each step's chunk and gives it to `write`, which writes it without awaiting, in
        place of waking the adapter's task (a coroutine and a task switch per chunk saved).

        `write(chunk)` returns True when the adapter's task must act before anything more is
        written (its socket's buffer is full, a stop string matched); the chunk counts as
        still being sent until the task next calls `ready`. Returns at once when output or the
        end is already waiting; else once the stream ended or failed, `write` returned True,
        or the chunk with the finish was written: the task goes on with `ready` and `take`.
        Raises what `write` raised (e.g. ConnectionError: the client went away)."""
        stream = self.stream
        if self._ended or stream.waiting_steps or stream.done:
            return
        stream.sending_since_ns = 0  # written: nothing pending until the next
        self._write = write
        stream.deliver = self._deliver
        try:
            await stream.waiter()
        finally:
            stream.deliver = None
            self._write = None
        error = self._write_error
        if error is not None:
            self._write_error = None
            raise error

    def _deliver(self) -> None:
        """`RequestStream.deliver` during `write_from_reader`: the output reader's call, once
        per step that brought output or the end."""
        stream = self.stream
        try:
            chunk = self.take()
        except RequestError:  # failed: fail() woke the task, whose `take` raises it
            return
        if chunk is None:
            act = True
        else:
            write = self._write
            assert write is not None  # set for the whole of write_from_reader, the only caller
            try:
                # Output left waiting (over one chunk's bytes): the task sends it, at once.
                act = write(chunk) or self._ended or stream.waiting_steps > 0
            except Exception as exc:
                self._write_error = exc
                act = True
        if act:
            stream.deliver = None  # the task takes over: later steps wake it
            stream.wake()
        else:
            stream.sending_since_ns = 0  # the write is complete: not a stalled client

    def take(self) -> Chunk | None:
        """The next chunk, everything waiting merged, once `ready` said there is one; None at
        the end (the request is then OK). Raises RequestError when the stream failed."""
        if self._ended:
            self.failure = None
            return None
        stream = self.stream
        if stream.error is not None:
            self.failure = stream.error[0]
            raise RequestError(*stream.error)
        chunk = stream.take_chunk()
        now = time.monotonic_ns()
        if chunk.index == 0:
            self.first_send_ns = now
            metrics = self.protocol_metrics
            metrics.ttft.observe((now - stream.received_ns) / 1e9)
            metrics.queue_wait.observe((stream.scheduled_ns - stream.received_ns) / 1e9)
        elif positions := chunk.outputs or len(chunk.token_ids):
            self.protocol_metrics.observe_itl((now - self._last_ns) / 1e9 / positions)
        self._last_ns = now
        self._ended = chunk.finish != Finish.NONE
        if chunk.timing is not None:
            chunk.timing.send_ns = now
        stream.sending_since_ns = now
        return chunk

    def write_waits(self) -> None:
        """The adapter's last write is not taken yet (its server's buffer for the call is
        full, or the client is not reading): the stall sweep (--stall-timeout) counts the
        wait from now, or from when it began counting one."""
        stream = self.stream
        if not stream.sending_since_ns:
            stream.sending_since_ns = time.monotonic_ns()

    def finish_here(self) -> None:
        """The adapter ended the output itself (an OpenAI stop string matched): the request
        counts as finished OK, and closing aborts its sequence in the worker."""
        self.failure = None

    def close(self) -> None:
        if (
            self.failure is Failure.CANCELLED
            and self.stream.error is None
            and (self.time_remaining is not None and (self.time_remaining() or 0.0) <= 0)
        ):
            self.failure = Failure.DEADLINE_EXCEEDED  # the call was cancelled at its deadline
        elif self.stream.error is not None:
            self.failure = self.stream.error[0]
        self._core.release(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
