"""OpenTelemetry traces out: one server span per request, whatever its protocol.

The span is made when the request ends, from the timestamps the core keeps anyway (received,
scheduled, first token, first send, end), so nothing is added while tokens flow: no span
object lives during the stream, and the SDK's batch processor exports from its own thread.
A request that arrived with a W3C `traceparent` (gRPC metadata, HTTP header) is a child of
its caller's span.

Attributes follow OpenTelemetry's GenAI conventions (`gen_ai.*`) where they exist. The hops
cadence timestamps are the latency attributes vLLM puts on its request spans (seconds from
the span's start), so a tool that reads vLLM's spans reads cadence's too:
`gen_ai.latency.time_in_queue` (to the engine step that took the request),
`gen_ai.latency.time_in_model_prefill` (that step), `gen_ai.latency.time_to_first_token` (to
the first chunk handed to the protocol). They are attributes, not span events: each event
costs the front about as much to build and export as the span's attributes together.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from cadence.vocabulary import Failure, Finish

log = logging.getLogger("cadence.tracing")

FINISH_REASONS = {Finish.LENGTH: "length", Finish.STOP: "stop", Finish.CANCELLED: "cancelled"}
"""A finish's name in `gen_ai.response.finish_reasons` (OpenAI's words)."""


def endpoint_from_env(environ: os._Environ | dict = os.environ) -> str:
    """The OTLP traces endpoint the standard variables name, or "" (tracing off)."""
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return ""
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() in ("none", ""):
        return ""
    return (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or ""
    )


def epoch_offset_ns() -> int:
    """This host's wall clock minus its monotonic clock (Unix ns = monotonic ns + offset), the
    smallest of a few readings' (the one least stretched by a preemption between the reads)."""
    readings = []
    for _ in range(5):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        readings.append((after - before, wall - (before + after) // 2))
    return min(readings)[1]


def trace_context(metadata) -> tuple[str, str]:
    """`traceparent` and `tracestate` from a gRPC call's metadata ("" where absent)."""
    parent = state = ""
    for key, value in metadata or ():
        if key == "traceparent":
            parent = value
        elif key == "tracestate":
            state = value
    return parent, state


class RequestTracer:
    """Exports one span per finished request to an OTLP endpoint (gRPC, or HTTP/protobuf
    when `OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL` says so and its exporter is installed)."""

    def __init__(self, endpoint: str, model: str, front: int = 0) -> None:
        from opentelemetry import propagate
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode

        resource = Resource.create(
            {
                "service.name": os.environ.get("OTEL_SERVICE_NAME") or "cadence",
                "cadence.front": front,
            }
        )
        # The SDK's sampler comes from OTEL_TRACES_SAMPLER (default: the caller's decision,
        # else always), and the batch processor's sizes from OTEL_BSP_*.
        # Shut down by `close` alone, bounded: the SDK's exit hook would wait for an
        # unreachable collector's retries.
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._exporter = _exporter(endpoint)
        self._provider.add_span_processor(BatchSpanProcessor(self._exporter))
        self._tracer = self._provider.get_tracer("cadence")
        self._model = model
        self._extract = propagate.extract
        """The caller's context from its traceparent (OTEL_PROPAGATORS: W3C by default)."""
        self._server_kind = SpanKind.SERVER
        self._error = (Status, StatusCode.ERROR)
        # Monotonic to epoch: the core's timestamps are time.monotonic_ns() (workers' too,
        # on this host); spans carry wall-clock nanoseconds.
        self._epoch_offset_ns = epoch_offset_ns()
        self._failed = False

    def record(self, generation) -> None:
        """One span for `generation` (a cadence.core.generation.Generation), which has just ended.
        Never raises: a tracing fault must not reach the request's call (its slot is already
        given back); the first one is logged."""
        try:
            self._record(generation)
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception(
                    "tracing: a request's span could not be made; later failures are not logged"
                )

    def _record(self, generation) -> None:
        stream = generation.stream
        request = generation.request
        protocol = generation.protocol_metrics.protocol
        offset = self._epoch_offset_ns
        parent = None
        if request.traceparent:
            carrier = {"traceparent": request.traceparent}
            if request.tracestate:
                carrier["tracestate"] = request.tracestate
            parent = self._extract(carrier)
        operation = generation.operation
        received, scheduled = stream.received_ns, stream.scheduled_ns
        first_token, first_send = stream.first_token_ns, generation.first_send_ns
        end = time.monotonic_ns()
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": self._model,
            "gen_ai.request.max_tokens": generation.max_tokens,
            "gen_ai.response.id": generation.request_id,
            "gen_ai.usage.input_tokens": stream.prompt_tokens,
            "gen_ai.usage.output_tokens": stream.sent_tokens,
            "gen_ai.latency.e2e": (end - received) / 1e9,
            "cadence.protocol": protocol,
            "cadence.worker": stream.worker,
        }
        # Sampling parameters only when asked for: every attribute costs its encoding.
        sampling = request.sampling
        if sampling.temperature:
            attributes["gen_ai.request.temperature"] = sampling.temperature
        if sampling.top_p:
            attributes["gen_ai.request.top_p"] = sampling.top_p
        if sampling.top_k:
            attributes["gen_ai.request.top_k"] = sampling.top_k
        if sampling.seed:
            attributes["gen_ai.request.seed"] = sampling.seed
        reason = FINISH_REASONS.get(stream.finish)
        if reason is not None:
            attributes["gen_ai.response.finish_reasons"] = (reason,)
        if scheduled:
            attributes["gen_ai.latency.time_in_queue"] = (scheduled - received) / 1e9
        if first_token and scheduled:
            attributes["gen_ai.latency.time_in_model_prefill"] = (first_token - scheduled) / 1e9
        if first_send:
            attributes["gen_ai.latency.time_to_first_token"] = (first_send - received) / 1e9
        failure = generation.failure
        if failure is not None:
            attributes["error.type"] = failure.name
        span = self._tracer.start_span(
            f"{operation} {self._model}",
            context=parent,
            kind=self._server_kind,
            attributes=attributes,
            start_time=received + offset,
        )
        if failure is not None:
            status, error = self._error
            span.set_status(status(error, _failure_text(generation, failure)))
        span.end(end_time=end + offset)

    def close(self, timeout_s: float = 2.0) -> None:
        """Export what is still batched, waiting at most `timeout_s`, then stop; spans a
        collector did not take by then are dropped, with one line. (The SDK's own flush
        waits out every retry of an unreachable collector, whatever its timeout.)"""
        flushed = threading.Event()

        def flush() -> None:
            self._provider.force_flush()
            flushed.set()

        threading.Thread(target=flush, name="otlp-flush", daemon=True).start()
        if flushed.wait(timeout_s):
            self._provider.shutdown()
            return
        log.warning(
            "tracing: the last spans were not exported within %g s (is the OTLP "
            "endpoint reachable?); they are dropped",
            timeout_s,
        )
        self._exporter.shutdown()  # ends the export that is still retrying


def _failure_text(generation, failure: Failure) -> str:
    error = generation.stream.error
    return error[1] if error is not None else failure.name


def _exporter(endpoint: str):
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    if protocol.startswith("http"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise RuntimeError(
                f"OTLP protocol {protocol!r} needs the package "
                "'opentelemetry-exporter-otlp-proto-http', which is not installed; install it "
                "or use the default protocol (grpc)"
            ) from None
        return OTLPSpanExporter(endpoint=endpoint or None)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint or None)
