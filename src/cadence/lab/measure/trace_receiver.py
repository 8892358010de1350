"""An OTLP/gRPC trace receiver for the length of a bench (`cadence bench --otlp-receive PORT`).

Any server pointed at it (cadence `--otlp-traces-endpoint`, vLLM `--otlp-traces-endpoint`, a
service instrumented with OpenTelemetry's SDK) sends its spans here; the bench keeps each one
as a small `ReceivedSpan` and joins them to its requests by trace id after the run
(analysis/server_spans.py). It speaks OpenTelemetry's own service definition
(`opentelemetry-proto`), so it is what a collector would be to the server.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

from cadence.lab.records import MAX_KEPT_BYTES, MAX_SPANS, ReceivedSpan

MAX_EXPORT_BYTES = 4 * 2**20
"""The largest export request taken (gRPC answers a larger one RESOURCE_EXHAUSTED, so the
exporter logs it): gRPC's and the OpenTelemetry Collector's default."""
MAX_TEXT = 256
"""Characters kept of a string attribute, a span's or an event's name, the service's name
or the status message; an attribute whose key is longer is left out. The split reads only
numbers and names, so nothing it needs is cut."""
MAX_ATTRIBUTES = 128
"""Attributes kept per span (the first), and events (the first: a first-token event comes
early in a request's span)."""
_SPAN_BYTES = 600
_ITEM_BYTES = 120
"""A span as the receiver reckons its memory: _SPAN_BYTES, its texts' characters, and
_ITEM_BYTES per attribute and event (CPython's objects around them)."""


def otlp_available() -> str | None:
    """Why the receiver cannot run here (one line), or None."""
    try:
        import opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc  # noqa: F401
    except ImportError:
        return (
            "--otlp-receive needs the package 'opentelemetry-proto', which is not "
            "installed; install it with: pip install 'cadence[otel]'"
        )
    return None


class TraceReceiver:
    """Listens on `host:port` (0: any free port; `port` after `start`) until `stop`."""

    def __init__(
        self,
        port: int,
        host: str = "0.0.0.0",
        max_spans: int = MAX_SPANS,
        max_bytes: int = MAX_KEPT_BYTES,
    ) -> None:
        self._address = f"{host}:{port}"
        self.port = port
        self._server = None
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._traces: set[str] = set()
        """The trace ids of the spans kept."""
        self.max_spans, self.max_bytes = max_spans, max_bytes
        self.kept_bytes = 0
        """The kept spans' memory, as `span_bytes` reckons it."""
        self.dropped = 0
        """Spans past `max_spans` or `max_bytes`, not kept."""
        self.last_export = 0.0

    def start(self) -> int:
        """Start listening; return the bound port. Raises OSError when the port is taken."""
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc

        receiver = self

        class Service(pb_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver._keep(request)
                return pb.ExportTraceServiceResponse()

        # No SO_REUSEPORT (grpc's default): a second receiver on the port would take half
        # the server's spans instead of failing.
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="otlp"),
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_EXPORT_BYTES),
            ],
        )
        pb_grpc.add_TraceServiceServicer_to_server(Service(), server)
        port = server.add_insecure_port(self._address)
        if not port:
            raise OSError(f"cannot listen on {self._address} for OTLP traces")
        server.start()
        self._server, self.port = server, port
        return port

    def _keep(self, request) -> None:
        spans = [span for resource in request.resource_spans for span in _spans_of(resource)]
        with self._lock:
            room = max(self.max_spans - len(self._spans), 0)
            kept = []
            for span in spans[:room]:
                size = span_bytes(span)
                if self.kept_bytes + size > self.max_bytes:
                    break
                self.kept_bytes += size
                kept.append(span)
            self._spans += kept
            self._traces.update(span.trace_id for span in kept)
            self.dropped += len(spans) - len(kept)
            self.last_export = time.monotonic()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, trace_ids: set[str], timeout_s: float, quiet_s: float = 1.0) -> None:
        """Return once a span of every trace in `trace_ids` came, or `timeout_s` passed; a
        server's batch processor sends what it holds every few seconds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                every_trace = trace_ids <= self._traces
            # Every trace seen, and a quiet moment: the server span of a request may follow
            # its children in a later batch.
            if every_trace and time.monotonic() - self.last_export >= min(quiet_s, timeout_s):
                return
            time.sleep(0.1)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None


def span_bytes(span: ReceivedSpan) -> int:
    """What one kept span costs in memory, about (see _SPAN_BYTES)."""
    texts = (
        len(span.name)
        + len(span.service)
        + len(span.error or "")
        + sum(len(k) + (len(v) if isinstance(v, str) else 8) for k, v in span.attributes.items())
        + sum(len(name) for name, _ in span.events)
    )
    return _SPAN_BYTES + texts + _ITEM_BYTES * (len(span.attributes) + len(span.events))


def _spans_of(resource_spans) -> list[ReceivedSpan]:
    service = next(
        (
            a.value.string_value[:MAX_TEXT]
            for a in resource_spans.resource.attributes
            if a.key == "service.name"
        ),
        "",
    )
    out = []
    for scope in resource_spans.scope_spans:
        for span in scope.spans:
            status = span.status
            error = (
                (status.message[:MAX_TEXT] or "error")
                if status.code == 2  # ERROR
                else None
            )
            out.append(
                ReceivedSpan(
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_id=span.parent_span_id.hex(),
                    name=span.name[:MAX_TEXT],
                    service=service,
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    attributes=_attributes(span.attributes),
                    events=[
                        (e.name[:MAX_TEXT], e.time_unix_nano) for e in span.events[:MAX_ATTRIBUTES]
                    ],
                    error=error,
                )
            )
    return out


def _attributes(attributes) -> dict[str, str | int | float | bool]:
    kept: dict[str, str | int | float | bool] = {}
    for a in attributes:
        if len(kept) == MAX_ATTRIBUTES:
            break
        if len(a.key) <= MAX_TEXT and (v := _scalar(a.value)) is not None:
            kept[a.key] = v[:MAX_TEXT] if isinstance(v, str) else v
    return kept


def _scalar(value) -> str | int | float | bool | None:
    kind = value.WhichOneof("value")
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(value, kind)
    return None
