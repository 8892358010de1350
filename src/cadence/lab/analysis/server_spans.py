"""The server's spans joined to the client's requests: where each first token's time went.

Every request goes out with a fresh W3C trace id (load/recording.py); a traced server's span for
it carries that id. For each request the *server span* is the outermost span the server sent
for its trace (its parent is the client's span, which no server sent); every other span of
the trace is one of its children. Time to first token then splits into:

- before: the client sent → the server span began (network, proxies, the server's accept
  and anything before its instrumentation);
- inside: the server span began → the server sent the first output, when the server says
  when (`gen_ai.latency.time_to_first_token`, as vLLM and cadence set it, or an event named
  `first_send`/`first_token_sent`), itself split into queue and prefill by child spans named so or by the attributes
  `gen_ai.latency.time_in_queue` and `gen_ai.latency.time_in_model_prefill`, and the rest;
- after: the server sent the first output → the client read it (network, proxies, the
  server's own send path past its instrumentation).

A server that does not say when it sent its first output (a plain instrumented gRPC service)
leaves inside and after as one: `inside_or_after`.

The server's span times are its wall clock; the client's are monotonic. They are joined
through this host's offset between the two, which holds for a server on this host; a server
on another host adds the hosts' clock difference (NTP: a few ms at worst) to before and after.
"""

from __future__ import annotations

from collections import defaultdict

from cadence.lab.percentile import distribution
from cadence.lab.records import ReceivedSpan, RequestRecord
from cadence.lab.results import RequestSpans, ServerSpans, SpanTime

FIRST_SEND_EVENTS = ("first_send", "first_token_sent")
TTFT_ATTRIBUTES = ("gen_ai.latency.time_to_first_token",)
QUEUE_ATTRIBUTES = ("gen_ai.latency.time_in_queue",)
PREFILL_ATTRIBUTES = ("gen_ai.latency.time_in_model_prefill",)
"""Seconds, as vLLM and cadence set them on their request spans."""
QUEUE_NAMES = ("queue",)
PREFILL_NAMES = ("prefill",)
"""A child span whose name holds one of these words is that part of the server's time."""
MAX_CHILDREN = 32
"""Child spans kept per request in the JSON (the earliest)."""
CLOCK_SLACK_MS = 1.0
"""A span that begins this much before its request was sent means the clocks disagree."""

SPLIT = ("before", "inside", "queue", "prefill", "inside_other", "after", "inside_or_after")
"""The parts of TTFT in `ServerSpans.ttft_split_ms`, in order."""

_NS_PER_MS = 1e6


def join_spans(
    records: list[RequestRecord],
    spans: list[ReceivedSpan],
    epoch_offset_ns: int,
    port: int,
    dropped: int = 0,
) -> ServerSpans:
    """`spans` joined to `records` by trace id; `epoch_offset_ns` is this host's wall clock
    minus its monotonic clock (Unix ns = monotonic ns + offset)."""
    by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    sent = [r for r in records if r.trace_id]
    joined = [j for r in sent if (j := _join(r, by_trace.get(r.trace_id), epoch_offset_ns))]
    parts: dict[str, list[float]] = {name: [] for name in SPLIT}
    for j in joined:
        if j.ttft_ms is None:
            continue
        for name in SPLIT:
            value = getattr(j, f"{name}_ms")
            if value is not None:
                parts[name].append(value)
    ours = {r.trace_id for r in sent}
    return ServerSpans(
        port=port,
        spans_received=len(spans),
        spans_dropped=dropped,
        sent=len(sent),
        matched=len(joined),
        foreign_traces=len(by_trace.keys() - ours),
        services=sorted({j.service for j in joined}),
        clock_suspect=sum(
            1 for j in joined if j.before_ms is not None and j.before_ms < -CLOCK_SLACK_MS
        ),
        ttft_split_ms={name: distribution(values) for name, values in parts.items() if values},
        requests=joined,
    )


def _join(
    record: RequestRecord, spans: list[ReceivedSpan] | None, offset: int
) -> RequestSpans | None:
    if not spans:
        return None
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_id not in ids]
    root = min(roots or spans, key=lambda s: s.start_ns)
    children = sorted((s for s in spans if s is not root), key=lambda s: s.start_ns)
    start = record.start_ns + offset  # the request's send, on the server spans' clock

    def ms(t_ns: int) -> float:
        return (t_ns - start) / _NS_PER_MS

    out = RequestSpans(
        request_id=record.request_id,
        trace_id=record.trace_id,
        service=root.service,
        name=root.name,
        start_ms=ms(root.start_ns),
        end_ms=ms(root.end_ns),
        error=root.error,
        children=[
            SpanTime(name=c.name, start_ms=ms(c.start_ns), end_ms=ms(c.end_ns))
            for c in children[:MAX_CHILDREN]
        ],
    )
    if record.code != "OK" or not record.arrival_ns:
        return out
    first_arrival = ms(record.arrival_ns[0] + offset)
    out.ttft_ms = first_arrival
    out.before_ms = out.start_ms
    out.queue_ms = _part(root, children, QUEUE_ATTRIBUTES, QUEUE_NAMES)
    out.prefill_ms = _part(root, children, PREFILL_ATTRIBUTES, PREFILL_NAMES)
    first_send = _first_send(root)
    if first_send is None:
        out.inside_or_after_ms = first_arrival - out.start_ms
        return out
    out.inside_ms = ms(first_send) - out.start_ms
    out.after_ms = first_arrival - ms(first_send)
    out.inside_other_ms = out.inside_ms - (out.queue_ms or 0.0) - (out.prefill_ms or 0.0)
    return out


def _first_send(root: ReceivedSpan) -> int | None:
    """When the server sent the request's first output (its clock, ns), if it says."""
    for name, at in root.events:
        if name in FIRST_SEND_EVENTS:
            return at
    for key in TTFT_ATTRIBUTES:
        value = root.attributes.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return root.start_ns + int(value * 1e9)
    return None


def _part(
    root: ReceivedSpan,
    children: list[ReceivedSpan],
    attributes: tuple[str, ...],
    words: tuple[str, ...],
) -> float | None:
    """One named part of the server's time (ms): from the root's attribute, else the child
    spans named so (added up), else None."""
    for key in attributes:
        value = root.attributes.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value * 1e3
    named = [c for c in children if any(w in c.name.lower() for w in words)]
    if not named:
        return None
    return sum(c.end_ns - c.start_ns for c in named) / _NS_PER_MS
