"""`inference.GRPCInferenceService`: the Open Inference Protocol (KServe v2 over gRPC, with
Triton's streaming extension) in front of cadence's data path.

Served on the same port as `cadence.v1.Inference`: an adapter between this protocol's wire and
the core (cadence.core.generation), like `Generate`'s. Every request of `ModelStreamInfer` is
mapped to the core's `Request` (model.py) and opened with `FrontCore.open`: the same
validation, admission, router, workers, per-request buffers, deadlines, metrics and cleanup.
What differs is the wire:

- One call carries many requests. Each gets a task that waits on its buffer and writes one
  `ModelStreamInferResponse` per chunk; the call's writes are serialised by a lock (gRPC
  allows one write in flight per call), and while a write waits, later tokens merge in the
  request's buffer exactly as they do for `Generate`.
- Every response carries the `triton_final_response` parameter, true on the request's last.
  When the last chunk has no tokens (the finish came after them), the final flag goes out
  alone, as an empty response, only to requests that set `triton_enable_empty_final_response`
  (as Triton does).
- Errors are in-band: a request that fails gets a response with `error_message` (starting
  with the gRPC status code name, e.g. "INVALID_ARGUMENT: ...", cadence.api.errors) and
  `infer_response.id`; the call goes on.
- The client half-closing the call means "no more requests": open requests finish, then the
  call ends OK. The call ending otherwise (client cancel, disconnect, deadline, the client
  not reading for --stall-timeout) aborts every request still open, in the engine too.
- `ModelInfer` (unary) answers UNIMPLEMENTED, as Triton does for decoupled models.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

import grpc
from google.protobuf.message import DecodeError

import cadence
from cadence.api.errors import end_cancelled_call, kserve_error_message
from cadence.api.kserve import model
from cadence.api.kserve.responses import ResponseEncoder
from cadence.core.errors import InvalidRequest, RequestError
from cadence.core.generation import FrontCore, Generation
from cadence.core.metrics import KSERVE
from cadence.core.tracing import trace_context
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.vocabulary import Failure, Finish

SERVICE_NAME = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

_FINISH_NAMES: dict[int, str] = {
    Finish.LENGTH: "length",
    Finish.STOP: "stop",
    Finish.CANCELLED: "cancelled",
}
"""The final response's `finish_reason` parameter (cadence's own; Triton has none)."""
_EXTENSIONS = ("model_configuration", "statistics", "parameters", "binary_tensor_data")


class KServeService:
    """Serves one decoupled model, `model_name`, through the front's `core`.

    `ready()` says whether the server takes requests (every worker up, not draining).
    `native`: served by the native server (`--grpc-server native`, net.asgi_grpc), which
    ends a cancelled call itself; otherwise by grpc.aio.
    """

    def __init__(
        self,
        core: FrontCore,
        model_name: str,
        ready: Callable[[], bool],
        *,
        native: bool = False,
    ) -> None:
        self.core = core
        self.native = native
        self.model_name = model_name
        self._ready = ready
        self._metadata = model.metadata(model_name)
        self._config = kpb.ModelConfigResponse(config=model.config(model_name))
        # ModelStatistics: per request, never per token.
        self._succeeded = self._succeeded_ns = self._failed = self._failed_ns = 0
        self._scheduled = self._queue_ns = self._compute_ns = 0
        self._last_inference_ms = 0

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The service's handlers by method name. ModelStreamInfer reads its requests as
        bytes, so that a malformed one gets an in-band error instead of ending the call, and
        writes bytes (cadence.api.kserve.responses encodes them)."""

        def unary(method, request_type, response_type) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=request_type.FromString,
                response_serializer=response_type.SerializeToString,
            )

        return {
            "ServerLive": unary(self.ServerLive, kpb.ServerLiveRequest, kpb.ServerLiveResponse),
            "ServerReady": unary(self.ServerReady, kpb.ServerReadyRequest, kpb.ServerReadyResponse),
            "ModelReady": unary(self.ModelReady, kpb.ModelReadyRequest, kpb.ModelReadyResponse),
            "ServerMetadata": unary(
                self.ServerMetadata, kpb.ServerMetadataRequest, kpb.ServerMetadataResponse
            ),
            "ModelMetadata": unary(
                self.ModelMetadata, kpb.ModelMetadataRequest, kpb.ModelMetadataResponse
            ),
            "ModelConfig": unary(self.ModelConfig, kpb.ModelConfigRequest, kpb.ModelConfigResponse),
            "ModelStatistics": unary(
                self.ModelStatistics, kpb.ModelStatisticsRequest, kpb.ModelStatisticsResponse
            ),
            "ModelInfer": unary(self.ModelInfer, kpb.ModelInferRequest, kpb.ModelInferResponse),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self.ModelStreamInfer),
        }

    def unknown_model(self, name: str, version: str) -> str | None:
        """Why `name`/`version` is not this server's model, or None if it is."""
        if name != self.model_name:
            return f"unknown model {name!r}; this server serves {self.model_name!r}"
        if version not in ("", model.MODEL_VERSION):
            return (
                f"model {name!r} has no version {version!r}; it has version "
                f"{model.MODEL_VERSION!r} (or leave the version empty)"
            )
        return None

    async def ServerLive(
        self, request: kpb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ServerLiveResponse:
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: kpb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ServerReadyResponse:
        return kpb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(
        self, request: kpb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ModelReadyResponse:
        ready = self.unknown_model(request.name, request.version) is None and self._ready()
        return kpb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(
        self, request: kpb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ServerMetadataResponse:
        return kpb.ServerMetadataResponse(
            name="cadence", version=cadence.__version__, extensions=_EXTENSIONS
        )

    async def ModelMetadata(
        self, request: kpb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ModelMetadataResponse:
        await self._abort_if_unknown(request.name, request.version, context)
        return self._metadata

    async def ModelConfig(
        self, request: kpb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ModelConfigResponse:
        await self._abort_if_unknown(request.name, request.version, context)
        return self._config

    async def ModelStatistics(
        self, request: kpb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> kpb.ModelStatisticsResponse:
        """Requests of ModelStreamInfer that finished OK (`success`, time from arrival to the
        last response) and that failed (`fail`); of those a worker took, the time before it
        did (`queue`: admission, routing, the worker's waiting queue) and after (`compute_infer`,
        to the last response). An empty name means every model. (perf_analyzer needs `queue`
        to find the model's version when none is given.)"""
        if request.name:
            await self._abort_if_unknown(request.name, request.version, context)
        stats = kpb.ModelStatistics(
            name=self.model_name,
            version=model.MODEL_VERSION,
            last_inference=self._last_inference_ms,
            inference_count=self._succeeded,
            execution_count=self._succeeded,
        )
        stats.inference_stats.success.count = self._succeeded
        stats.inference_stats.success.ns = self._succeeded_ns
        stats.inference_stats.fail.count = self._failed
        stats.inference_stats.fail.ns = self._failed_ns
        infer = stats.inference_stats
        # Clients (perf_analyzer) expect the three compute counts to agree; cadence does not
        # time input and output handling apart, so those two take no time.
        for duration in (
            infer.queue,
            infer.compute_input,
            infer.compute_infer,
            infer.compute_output,
        ):
            duration.count = self._scheduled
        infer.queue.ns = self._queue_ns
        infer.compute_infer.ns = self._compute_ns
        return kpb.ModelStatisticsResponse(model_stats=[stats])

    async def ModelInfer(  # type: ignore[return]  # grpc is untyped: abort() raises
        self,
        request: kpb.ModelInferRequest,
        context: grpc.aio.ServicerContext,
    ) -> kpb.ModelInferResponse:
        await self._abort_if_unknown(request.model_name, request.model_version, context)
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"ModelInfer does not support models with decoupled transaction policy: model "
            f"{self.model_name!r} answers one response per chunk of output; use ModelStreamInfer",
        )

    async def _abort_if_unknown(
        self, name: str, version: str, context: grpc.aio.ServicerContext
    ) -> None:
        problem = self.unknown_model(name, version)
        if problem is not None:
            await context.abort(grpc.StatusCode.NOT_FOUND, problem)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        call = _StreamCall(self, context)
        try:
            async for raw in requests:
                await call.start(raw, time.monotonic_ns())
            # Half-closed by the client: no more requests; let the open ones finish.
            await call.wait_for_all()
        finally:
            # Any other end of the call (cancel, disconnect, deadline, stall): abort the rest.
            await call.cancel_all()

    def record(self, ok: bool, received_ns: int, scheduled_ns: int = 0) -> None:
        """Count one finished ModelStreamInfer request for ModelStatistics; `scheduled_ns`:
        when a worker took it (0: never)."""
        now = time.monotonic_ns()
        elapsed = now - received_ns
        if scheduled_ns:
            self._scheduled += 1
            self._queue_ns += max(scheduled_ns - received_ns, 0)
            self._compute_ns += max(now - scheduled_ns, 0)
        if ok:
            self._succeeded += 1
            self._succeeded_ns += elapsed
        else:
            self._failed += 1
            self._failed_ns += elapsed
        self._last_inference_ms = time.time_ns() // 1_000_000  # the protocol's epoch ms


class _StreamCall:
    """One ModelStreamInfer call: its open requests' tasks and the lock on its writes."""

    __slots__ = ("_context", "_handler", "_kserve", "_lock", "_tasks", "_trace")

    def __init__(self, kserve: KServeService, context: grpc.aio.ServicerContext) -> None:
        self._kserve = kserve
        self._context = context
        self._tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self._handler = asyncio.current_task()
        """Cancelled by the stall sweep: a client that reads nothing stalls the whole call."""
        self._trace = (
            trace_context(context.invocation_metadata()) if kserve.core.tracer is not None else None
        )
        """The call's trace context, shared by every request it carries (tracing on)."""

    async def start(self, raw: bytes, received_ns: int) -> None:
        """Start one request's stream, or answer it with an in-band error."""
        kserve = self._kserve
        request_id = ""
        try:
            try:
                request = kpb.ModelInferRequest.FromString(raw)
            except DecodeError as exc:
                raise InvalidRequest(
                    f"the request is not a valid inference.ModelInferRequest: {exc}"
                ) from None
            request_id = request.id
            problem = kserve.unknown_model(request.model_name, request.model_version)
            if problem is not None:
                raise RequestError(Failure.NOT_FOUND, problem)
            translated = model.to_stream_request(request)
            if self._trace is not None:
                translated.request.traceparent, translated.request.tracestate = self._trace
        except RequestError as exc:
            kserve.core.refused(exc.failure, KSERVE)
            await self._fail(request_id, exc)
            return
        try:
            # Triton does not require unique ids: they are only echoed.
            generation = kserve.core.open(
                translated.request,
                received_ns,
                self._context.time_remaining,
                protocol=KSERVE,
                unique_id=False,
                task=self._handler,
                # grpc.aio leaves a cancelled handler's call without a status.
                end_call=None if kserve.native else partial(end_cancelled_call, self._context),
            )
        except RequestError as exc:  # counted by the core
            await self._fail(request_id, exc)
            return
        task = asyncio.get_running_loop().create_task(self._serve(generation, translated))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, generation: Generation, translated: model.StreamRequest) -> None:
        """Write one response per chunk of one request until its last."""
        kserve = self._kserve
        request_id = translated.request.request_id
        encoder = ResponseEncoder(
            kserve.model_name,
            model.MODEL_VERSION,
            request_id,
            translated.want_tokens,
            translated.want_text,
        )
        empty_final = translated.empty_final
        try:
            with generation:
                try:
                    async for chunk in generation:
                        final = chunk.finish != Finish.NONE
                        finish = _FINISH_NAMES[chunk.finish] if final else None
                        if chunk.token_ids or chunk.outputs:
                            response = encoder.chunk(
                                chunk.token_ids,
                                chunk.text,
                                finish,
                                chunk.cached_tokens,
                                chunk.outputs,
                            )
                        elif empty_final:  # the finish came after the last tokens
                            assert finish is not None  # only the last chunk has no tokens
                            response = encoder.final_only(finish, chunk.cached_tokens)
                        else:
                            continue  # as Triton: the final flag alone only when asked
                        async with self._lock:
                            await self._context.write(response)
                except RequestError as exc:
                    await self._write(_error(request_id, exc))
        finally:
            kserve.record(
                generation.failure is None, generation.received_ns, generation.scheduled_ns
            )

    async def _fail(self, request_id: str, exc: RequestError) -> None:
        """Answer a request that never started with an in-band error."""
        self._kserve.record(False, time.monotonic_ns())
        await self._write(_error(request_id, exc))

    async def _write(self, response: bytes) -> None:
        async with self._lock:
            await self._context.write(response)

    async def wait_for_all(self) -> None:
        """Until every open request has sent its last response (or failed)."""
        while self._tasks:
            # A task that raised did so because the call broke; the call's end reports it.
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel_all(self) -> None:
        """Cancel every open request's task and wait for their cleanup (engine aborts)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _error(request_id: str, exc: RequestError) -> bytes:
    """One request's failure, in-band (cadence.api.errors names it), with the request's id."""
    response = kpb.ModelStreamInferResponse(
        error_message=kserve_error_message(exc.failure, exc.message)
    )
    response.infer_response.id = request_id
    return response.SerializeToString()
