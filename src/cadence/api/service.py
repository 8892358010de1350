"""The gRPC service: validation, admission, routing, and one stream loop per request.

`open_stream` is the one way into the data path (admission, routing, the per-request buffer,
the deadline, cleanup); `Generate` here and the Open Inference Protocol's `ModelStreamInfer`
(cadence.api.kserve.service) both go through it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import msgspec
from google.protobuf.message import DecodeError

from cadence.api.metrics import FrontMetrics
from cadence.api.request_stream import RequestStream
from cadence.api.v1 import inference_pb2 as pb
from cadence.config import ServerConfig
from cadence.engines.tokenizer import ByteTokenizer
from cadence.router import AdmissionGate, WorkerRouter
from cadence.router.worker_router import NoWorkerAvailable
from cadence.transport.channel import WorkerLink
from cadence.transport.messages import AddRequest, Finish


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


class InvalidRequest(ValueError):
    """The request cannot be served as sent; the message says what to change."""


class Refused(Exception):
    """The server will not start this request now: a gRPC status code and why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InferenceService:
    """Serves `cadence.v1.Inference`; each stream waits on its own buffer, never on a thread.

    `Generate` receives the request still serialized (see `method_handlers`), so that a
    malformed one gets INVALID_ARGUMENT with a reason instead of gRPC's bare INTERNAL.
    """

    def __init__(
        self,
        config: ServerConfig,
        streams: dict[int, RequestStream],
        links: list[WorkerLink],
        router: WorkerRouter,
        metrics: FrontMetrics,
        *,
        front: int = 0,
        gate: AdmissionGate | None = None,
    ) -> None:
        self._config = config
        self._streams = streams
        self._links = links
        self._router = router
        self._gate = gate or AdmissionGate(config.max_concurrent)
        self._tokenizer = ByteTokenizer()
        self._text_to_worker = config.engine.name == "torch"
        """The torch engine tokenizes text prompts with the model's own tokenizer."""
        fronts = config.fronts
        self._seq_ids = itertools.count(fronts + front, fronts)
        """Sequence ids; with `--fronts N` front k's are k (mod N), so a worker knows whose
        each is (one front: 1, 2, 3, ...)."""
        self._front_metadata = (
            (("cadence-front", str(front)), ("cadence-front-pid", str(os.getpid())))
            if fronts > 1 else None
        )
        """`--fronts N`: initial metadata naming the front that serves a stream."""
        self.metrics = metrics
        metrics.watch(
            active=lambda: self._gate.active,
            deepest_buffer=lambda: max((s.waiting_steps for s in streams.values()), default=0),
        )
        self._request_ids: set[str] = set()
        """Client-chosen request ids of the open streams: a duplicate is refused."""
        self.refusal: str | None = "the server is starting; retry shortly"
        """Why new requests are refused (start-up, drain), or None while serving."""

    @property
    def active(self) -> int:
        return self._gate.active

    def next_seq_id(self) -> int:
        """A new front-wide sequence id, for another protocol's handler (see `open_stream`)."""
        return next(self._seq_ids)

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The service's handlers by method name, taking the request as bytes and parsing it
        in `Generate`."""
        return {"Generate": grpc.unary_stream_rpc_method_handler(
            self.Generate, response_serializer=pb.GenerateChunk.SerializeToString)}

    async def sweep_stalled(self, stall_timeout_s: float) -> None:
        """Forever: cut off streams whose client has read nothing for `stall_timeout_s`.

        A write that has not completed for that long means the client's flow-control
        window is full and it is not reading; its handler is cancelled and its slot freed.
        """
        limit_ns = int(stall_timeout_s * 1e9)
        while True:
            await asyncio.sleep(min(1.0, stall_timeout_s / 4))
            now = time.monotonic_ns()
            for stream in list(self._streams.values()):
                since = stream.sending_since_ns
                if since and now - since > limit_ns and stream.task is not None:
                    stream.fail(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the client read nothing for {stall_timeout_s:g} s (--stall-timeout)",
                    )
                    stream.task.cancel()

    def to_add_request(self, seq_id: int, request: pb.GenerateRequest) -> AddRequest:
        """Check a request and turn it into the worker's message, or raise InvalidRequest."""
        config = self._config
        if request.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if request.max_tokens > config.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens is {request.max_tokens}; this server allows at most "
                f"{config.max_tokens_limit} (--max-tokens-limit)"
            )
        prompt_text = ""
        if request.prompt_token_ids:
            prompt = list(request.prompt_token_ids)
            if min(prompt) < 0:
                raise InvalidRequest("prompt_token_ids must not be negative")
        elif request.prompt and self._text_to_worker:
            # Tokenized, counted and checked against the model's context by the worker.
            prompt, prompt_text = [], request.prompt
        elif request.prompt:
            prompt = self._tokenizer.encode(request.prompt)
        else:
            raise InvalidRequest("the prompt is empty: set prompt or prompt_token_ids")
        if len(prompt) > config.max_prompt_tokens:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; this server allows at most "
                f"{config.max_prompt_tokens} (--max-prompt-tokens)"
            )
        sampling = request.sampling
        if not sampling.temperature >= 0 or math.isinf(sampling.temperature):
            raise InvalidRequest("sampling.temperature must be a finite number, 0 (greedy) or more")
        if not 0 <= sampling.top_p <= 1:
            raise InvalidRequest("sampling.top_p must be between 0 and 1")
        return AddRequest(
            seq_id,
            prompt,
            request.max_tokens,
            list(request.stop_token_ids),
            sampling.temperature,
            sampling.top_p,
            sampling.top_k,
            sampling.seed,
            prompt_text=prompt_text,
        )

    def open_stream(
        self,
        add: AddRequest,
        request_id: str,
        received_ns: int,
        time_remaining: Callable[[], float | None],
        *,
        include_timing: bool = False,
        unique_id: bool = True,
        task: asyncio.Task | None = None,
    ) -> OpenStream:
        """Admit a checked request, route it, and start it in a worker; raise Refused if not.

        Every protocol's handler comes through here, so all share admission, routing,
        per-request buffers, deadlines and cleanup. Use the result in a `with` block at once:
        leaving the block ends the request (see `OpenStream`). `request_id` is the client's
        (empty: the server assigns one); with `unique_id` a duplicate of an open stream's id
        is refused. `time_remaining` is the call's gRPC deadline (seconds left, None: no
        deadline). `task` is cancelled if the client stops reading (default: the current one).
        """
        metrics = self.metrics
        if unique_id and request_id in self._request_ids:
            metrics.requests.labels("INVALID_ARGUMENT").inc()
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id {request_id!r} is already streaming; use a unique id "
                "or leave it empty for the server to assign one",
            )
        if not self._gate.try_enter():
            metrics.requests.labels("RESOURCE_EXHAUSTED").inc()
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is serving its limit of {self._gate.limit} streams "
                "(--max-concurrent); retry later",
            )
        try:
            worker = self._router.pick()
        except NoWorkerAvailable:
            self._gate.leave()
            metrics.requests.labels("UNAVAILABLE").inc()
            raise Refused(grpc.StatusCode.UNAVAILABLE, "no worker is running on this server") from None

        config = self._config
        seq_id = add.seq_id
        stream = RequestStream(
            seq_id,
            request_id or uuid.uuid4().hex,
            worker,
            add.max_tokens,
            len(add.prompt_token_ids),
            capacity=config.queue_capacity,
            overflow=config.overflow,
            include_timing=include_timing,
            decoder=self._tokenizer.stream_decoder(),
            received_ns=received_ns,
            link=self._links[worker],
            tally=self.metrics.tally,
        )
        stream.task = task or asyncio.current_task()
        self._streams[seq_id] = stream
        owns_id = unique_id and bool(request_id)
        if owns_id:
            self._request_ids.add(request_id)
        remaining = time_remaining()
        if remaining is not None:
            # The worker learns the deadline too, so an app function can see it.
            add = msgspec.structs.replace(add, timeout_ms=max(remaining * 1e3, 0.001))
        self._router.assign(worker, add.max_tokens)
        self._links[worker].add(add)
        deadline = None
        if remaining is not None:
            deadline = asyncio.get_running_loop().call_later(
                max(remaining, 0.0),
                stream.fail,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the request's deadline passed before generation finished",
            )
        return OpenStream(self, stream, add.max_tokens, request_id if owns_id else None,
                          deadline, remaining is not None, time_remaining)

    async def Generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        received_ns = time.monotonic_ns()
        metrics = self.metrics
        if self.refusal is not None:
            metrics.requests.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal)
        seq_id = next(self._seq_ids)
        try:
            request = pb.GenerateRequest.FromString(raw)
            add = self.to_add_request(seq_id, request)
        except (InvalidRequest, DecodeError) as exc:
            metrics.requests.labels("INVALID_ARGUMENT").inc()
            if isinstance(exc, DecodeError):
                exc = f"the request is not a valid cadence.v1.GenerateRequest: {exc}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            opened = self.open_stream(add, request.request_id, received_ns,
                                      context.time_remaining,
                                      include_timing=request.include_timing)
        except Refused as exc:
            await context.abort(exc.code, exc.message)

        if self._front_metadata is not None:
            await context.send_initial_metadata(self._front_metadata)
        stream = opened.stream
        observe_itl = metrics.itl.observe
        last_ns = received_ns
        with opened:
            while True:
                await stream.wait()
                if stream.error is not None:
                    # Status set and return rather than abort(): the call may have ended
                    # already (a deadline races gRPC's own), and abort() would raise then.
                    context.set_code(stream.error[0])
                    context.set_details(stream.error[1])
                    return
                chunk = stream.take_chunk()
                now = time.monotonic_ns()
                if chunk.index == 0:
                    metrics.ttft.observe((now - received_ns) / 1e9)
                    metrics.queue_wait.observe((stream.scheduled_ns - received_ns) / 1e9)
                elif chunk.token_ids:
                    observe_itl((now - last_ns) / 1e9 / len(chunk.token_ids))
                last_ns = now
                stream.sending_since_ns = now
                yield chunk
                stream.sending_since_ns = 0
                # Not stream.finish: it may have been set while this chunk was being sent,
                # with the last tokens still waiting.
                if chunk.finish_reason:
                    opened.code = grpc.StatusCode.OK
                    return


class OpenStream:
    """One admitted request, from `InferenceService.open_stream` to the end of its `with`.

    The handler reads `stream` and sets `code` to OK once the last chunk is sent. Leaving
    the block, however it is left (finished, failed, client cancel, deadline), gives back
    what the request held: the deadline timer, its place in the front's streams, the
    router's work and the admission slot; a sequence the worker has not finished is aborted
    there. Per-request metrics are recorded with the final status code.
    """

    __slots__ = ("_deadline", "_has_deadline", "_max_tokens", "_request_id", "_service",
                 "_time_remaining", "code", "stream")

    def __init__(
        self,
        service: InferenceService,
        stream: RequestStream,
        max_tokens: int,
        request_id: str | None,
        deadline: asyncio.TimerHandle | None,
        has_deadline: bool,
        time_remaining: Callable[[], float | None],
    ) -> None:
        self._service = service
        self.stream = stream
        self.code = grpc.StatusCode.CANCELLED
        """The status the request ended with, unless the stream failed with its own."""
        self._max_tokens = max_tokens
        self._request_id = request_id
        """The client's id held in the service's set of open ids, or None."""
        self._deadline = deadline
        self._has_deadline = has_deadline
        self._time_remaining = time_remaining

    def __enter__(self) -> RequestStream:
        return self.stream

    def __exit__(self, *exc_info: object) -> None:
        service, stream = self._service, self.stream
        if self._deadline is not None:
            self._deadline.cancel()
        del service._streams[stream.seq_id]
        if self._request_id is not None:
            service._request_ids.discard(self._request_id)
        code = self.code if stream.error is None else stream.error[0]
        worker = stream.worker
        service._router.release(worker, self._max_tokens)
        service._gate.leave()
        if stream.finish in (Finish.NONE, Finish.CANCELLED):
            # Cancelled, past its deadline, failed or drained: the worker drops it at its
            # next step.
            service._links[worker].abort(stream.seq_id)
        if code == grpc.StatusCode.CANCELLED and self._has_deadline and (
            self._time_remaining() or 0.0
        ) <= 0:
            code = grpc.StatusCode.DEADLINE_EXCEEDED  # gRPC cancelled us at the deadline
        metrics = service.metrics
        metrics.requests.labels(code.name).inc()
        metrics.e2e.observe((time.monotonic_ns() - stream.received_ns) / 1e9)
