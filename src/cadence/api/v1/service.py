"""`cadence.v1.Inference`: the adapter between cadence's own wire and the core.

`Generate` maps a `GenerateRequest` to the core's `Request`, each `Chunk` to a
`GenerateChunk`, and a failure to the call's status (cadence.api.errors); the core does the
rest (cadence.core.generation). It receives the request still serialized (see `handlers`), so that
a malformed one gets INVALID_ARGUMENT with a reason instead of gRPC's bare INTERNAL.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from functools import partial

import grpc
from google.protobuf.message import DecodeError

from cadence.api.errors import end_cancelled_call, grpc_status
from cadence.core.errors import InvalidRequest, RequestError
from cadence.core.generation import FrontCore, Generation
from cadence.core.metrics import CADENCE_V1
from cadence.core.requests import Chunk, Request
from cadence.core.tracing import trace_context
from cadence.proto.v1 import inference_pb2 as pb
from cadence.vocabulary import Sampling

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


def to_request(raw: bytes) -> Request:
    """A serialized `GenerateRequest` as the core's request; raise InvalidRequest."""
    try:
        message = pb.GenerateRequest.FromString(raw)
    except DecodeError as exc:
        raise InvalidRequest(
            f"the request is not a valid cadence.v1.GenerateRequest: {exc}"
        ) from None
    sampling = message.sampling
    return Request(
        request_id=message.request_id,
        prompt=message.prompt,
        prompt_token_ids=list(message.prompt_token_ids),
        max_tokens=message.max_tokens,
        sampling=Sampling(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            stop_token_ids=tuple(message.stop_token_ids),
        ),
        include_timing=message.include_timing,
        priority=message.priority,
    )


def to_chunk(chunk: Chunk, request_id: str) -> pb.GenerateChunk:
    """A core chunk as a `GenerateChunk` of request `request_id`."""
    # Only fields that differ from proto3's defaults are set: each set costs as much as a
    # field's encoding, and a zero is not sent either way.
    out = pb.GenerateChunk(
        request_id=request_id, index=chunk.index, token_ids=chunk.token_ids, text=chunk.text
    )
    if chunk.finish:
        out.finish_reason = chunk.finish  # type: ignore[assignment]  # protoc's .pyi wants the enum class; its int value is what protobuf takes
    if chunk.prompt_tokens:  # the first chunk's
        out.prompt_tokens = chunk.prompt_tokens
    if chunk.cached_tokens and chunk.finish:  # on the last chunk
        out.cached_tokens = chunk.cached_tokens
    if chunk.outputs:  # a model's text pieces: positions are not one per token id
        out.outputs = chunk.outputs
    timing = chunk.timing
    if timing is not None:
        wire = out.timing
        wire.send_ns = timing.send_ns  # never 0: the timing is present even on worker 0
        if timing.worker:
            wire.worker = timing.worker
        if timing.received_ns:  # the first chunk's
            wire.received_ns = timing.received_ns
            wire.scheduled_ns = timing.scheduled_ns
        if timing.step_start_ns:  # a chunk with tokens
            wire.step_start_ns = timing.step_start_ns
            wire.step_end_ns = timing.step_end_ns
            wire.front_recv_ns = timing.front_recv_ns
            if timing.step_cpu_wait_ns >= 0:  # measured (absent, not 0, where it is not)
                wire.step_cpu_wait_ns = timing.step_cpu_wait_ns
        if timing.handoff_ns:  # disaggregated serving
            wire.prefill_worker = timing.prefill_worker
            wire.handoff_ns = timing.handoff_ns
    return out


async def _write_from_the_reader(generation: Generation, context, request_id: str) -> None:
    """A stream on a server whose context writes without awaiting (`write_now`: the native
    server, net.asgi_grpc): its chunks are written by the output reader
    (`Generation.write_from_reader`), with no task woken per chunk. While a message is not
    taken yet (Envoy's thread is behind, or its buffer for the stream is full) one more is
    handed over, then the task waits for them and sends all that waited meanwhile as one
    message, as grpc.aio's path merges a stream whose write waits."""
    take, write_now, in_flight = generation.take, context.write_now, context.in_flight

    def write(chunk: Chunk) -> bool:
        behind = in_flight()
        write_now(to_chunk(chunk, request_id))
        return behind

    while True:
        if in_flight():
            generation.write_waits()
        await context.flushed()
        waiter = generation.ready()
        if waiter is not None:
            await waiter
        chunk = take()
        if chunk is None:
            return
        write_now(to_chunk(chunk, request_id))
        await generation.write_from_reader(write)


class InferenceService:
    """Serves `cadence.v1.Inference` through `core`; each stream waits on its own buffer.

    `metadata`: initial metadata for every stream (`--fronts N`: which front serves it).
    `native`: served by the native server (`--grpc-server native`, net.asgi_grpc), whose
    contexts write without awaiting (`write_now`) and end a cancelled call themselves;
    otherwise by grpc.aio.
    """

    def __init__(
        self,
        core: FrontCore,
        metadata: tuple[tuple[str, str], ...] | None = None,
        *,
        native: bool = False,
    ) -> None:
        self._core = core
        self._native = native
        self._metadata = metadata
        self._lag_sent = ""
        """The loop-lag tally that a stream's initial metadata last carried."""

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The service's handlers by method name, taking the request as bytes."""
        return {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, response_serializer=pb.GenerateChunk.SerializeToString
            )
        }

    async def Generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        received_ns = time.monotonic_ns()
        core = self._core
        try:
            request = to_request(raw)
        except InvalidRequest as exc:
            core.refused(exc.failure, CADENCE_V1)
            await context.abort(grpc_status(exc.failure), exc.message)
        if core.tracer is not None:
            request.traceparent, request.tracestate = trace_context(context.invocation_metadata())
        try:
            generation = core.open(
                request,
                received_ns,
                context.time_remaining,
                protocol=CADENCE_V1,
                # grpc.aio leaves a cancelled handler's call without a status.
                end_call=None if self._native else partial(end_cancelled_call, context),
            )
        except RequestError as exc:  # counted by the core
            await context.abort(grpc_status(exc.failure), exc.message)
        lag = core.metrics.loop_lag_tally if request.include_timing else None
        initial = self._metadata
        if lag is not None:
            # The front's loop lag so far, at the end of a timed stream and at its start: the
            # lab's evidence of a blocked loop, with or without a metrics endpoint. The start's
            # only when it moved since a stream last carried it (the lab reads the earliest
            # start's), so a burst of new calls pays one gRPC operation for it, not one each.
            start = lag.encoded()
            if start != self._lag_sent:
                self._lag_sent = start
                initial = (*(initial or ()), (lag.KEY, start))
        request_id = generation.request_id
        with generation:
            try:
                if initial is not None:
                    # At the intake's next lull, not now: a send of its own is one more gRPC
                    # operation, which in a burst of new calls slows the calls behind.
                    await core.intake_lull(generation)
                    with contextlib.suppress(grpc.aio.BaseError):  # the call ended meanwhile
                        await context.send_initial_metadata(initial)
                if self._native:
                    await _write_from_the_reader(generation, context, request_id)
                else:
                    async for chunk in generation:
                        yield to_chunk(chunk, request_id)
            except RequestError as exc:
                # Status set and return rather than abort(): the call may have ended
                # already (a deadline races gRPC's own), and abort() would raise then.
                context.set_code(grpc_status(exc.failure))
                context.set_details(exc.message)
            if lag is not None:
                context.set_trailing_metadata(((lag.KEY, lag.encoded()),))
