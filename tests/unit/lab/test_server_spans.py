"""The server's spans joined to the client's requests, and the rules that read the split."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.analysis.server_spans import join_spans
from cadence.lab.measure.trace_receiver import ReceivedSpan
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult

MS = 1_000_000
OFFSET = 1_700_000_000 * 10**9
"""Wall clock minus monotonic clock in these tests."""


def record(n: int, start_ms: float, first_ms: float, code: str = "OK") -> RequestRecord:
    start = int(start_ms * MS)
    return RequestRecord(
        request_id=f"r{n}",
        process=0,
        start_ns=start,
        code=code,
        arrival_ns=[start + int(first_ms * MS)] if code == "OK" else [],
        tokens=[1] if code == "OK" else [],
        index=[0] if code == "OK" else [],
        trace_id=f"{n:032x}",
    )


def span(
    n: int,
    name: str,
    start_ms: float,
    end_ms: float,
    *,
    span_id: str = "aa",
    parent: str = "ff",
    attributes: dict | None = None,
    events: list | None = None,
    service: str = "svc",
) -> ReceivedSpan:
    return ReceivedSpan(
        trace_id=f"{n:032x}",
        span_id=span_id,
        parent_id=parent,
        name=name,
        service=service,
        start_ns=OFFSET + int(start_ms * MS),
        end_ns=OFFSET + int(end_ms * MS),
        attributes=attributes or {},
        events=[(e, OFFSET + int(t * MS)) for e, t in events or []],
        error=None,
    )


def cadence_like(
    n: int, start: float, before: float, queue: float, prefill: float, to_send: float
) -> ReceivedSpan:
    """A span with its first send as an event, queue and prefill as attributes."""
    s = start + before
    return span(
        n,
        "text_completion m",
        s,
        s + 100,
        service="cadence",
        events=[
            ("cadence.scheduled", s + queue),
            ("cadence.first_token", s + queue + prefill),
            ("first_send", s + queue + prefill + to_send),
        ],
        attributes={
            "gen_ai.latency.time_in_queue": queue / 1e3,
            "gen_ai.latency.time_in_model_prefill": prefill / 1e3,
        },
    )


def test_a_span_with_a_first_send_splits_ttft_into_parts_that_add_up() -> None:
    # Sent at 10 ms; span from 13 ms; queue 5, prefill 20, 1 more to the send; read at 41.
    spans = join_spans([record(1, 10, 31)], [cadence_like(1, 10, 3, 5, 20, 1)], OFFSET, 4317)
    assert (spans.sent, spans.matched, spans.services) == (1, 1, ["cadence"])
    [r] = spans.requests
    assert r.ttft_ms == 31 and r.before_ms == 3 and r.inside_ms == 26 and r.after_ms == 2
    assert (r.queue_ms, r.prefill_ms) == (5, 20) and abs(r.inside_other_ms - 1) < 1e-9
    assert r.before_ms + r.inside_ms + r.after_ms == r.ttft_ms
    assert set(spans.ttft_split_ms) == {
        "before",
        "inside",
        "queue",
        "prefill",
        "inside_other",
        "after",
    }


def test_the_outermost_span_is_the_servers_and_child_spans_name_the_parts() -> None:
    # A proxy span around the server's, and a child named "queue"; no first-send mark.
    spans = [
        span(1, "proxy", 2, 60, span_id="01", parent="ff"),
        span(1, "/svc/Generate", 4, 58, span_id="02", parent="01"),
        span(1, "wait in queue", 5, 35, span_id="03", parent="02"),
    ]
    joined = join_spans([record(1, 0, 40), record(2, 0, 40)], spans, OFFSET, 1)
    assert joined.matched == 1 and joined.sent == 2
    [r] = joined.requests
    assert r.name == "proxy" and [c.name for c in r.children] == ["/svc/Generate", "wait in queue"]
    assert r.inside_ms is None and r.inside_or_after_ms == 38 and r.queue_ms == 30
    assert "inside" not in joined.ttft_split_ms


def test_vllm_attributes_give_the_first_output_without_an_event() -> None:
    vllm = span(
        1,
        "llm_request",
        5,
        90,
        attributes={
            "gen_ai.latency.time_to_first_token": 0.030,
            "gen_ai.latency.time_in_queue": 0.012,
        },
    )
    [r] = join_spans([record(1, 0, 37)], [vllm], OFFSET, 1).requests
    assert r.before_ms == 5 and r.inside_ms == 30 and r.after_ms == 2 and r.queue_ms == 12


def test_other_traces_and_failed_requests_are_counted_apart() -> None:
    joined = join_spans(
        [record(1, 0, 0, code="UNAVAILABLE")],
        [span(1, "x", 1, 2), span(99, "health", 0, 1)],
        OFFSET,
        1,
    )
    assert joined.matched == 1 and joined.foreign_traces == 1
    assert joined.requests[0].ttft_ms is None and not joined.ttft_split_ms


def run_with(spans) -> BenchResult:
    result = BenchResult()
    result.server_spans = spans
    return result


def rules(result: BenchResult) -> set[str]:
    return {f.rule for f in diagnose(result)}


def test_time_before_the_server_span_is_named() -> None:
    records = [record(n, 0, 60) for n in range(20)]
    spans = [cadence_like(n, 0, 40, 2, 10, 1) for n in range(20)]
    found = rules(run_with(join_spans(records, spans, OFFSET, 1)))
    assert "ttft_before_server" in found and "ttft_after_server" not in found


def test_time_after_the_server_sent_is_named() -> None:
    records = [record(n, 0, 60) for n in range(20)]
    spans = [cadence_like(n, 0, 1, 2, 10, 1) for n in range(20)]  # sent at 14, read at 60
    found = rules(run_with(join_spans(records, spans, OFFSET, 1)))
    assert "ttft_after_server" in found and "ttft_before_server" not in found


def test_a_servers_own_queue_is_named_and_small_parts_are_not() -> None:
    records = [record(n, 0, 60) for n in range(20)]
    queued = [cadence_like(n, 0, 1, 45, 10, 1) for n in range(20)]
    assert rules(run_with(join_spans(records, queued, OFFSET, 1))) == {"ttft_server_queue"}
    quick = [record(n, 0, 8) for n in range(20)]  # 5 of 8 ms before: a share, not a finding
    early = [cadence_like(n, 0, 5, 1, 1, 0.5) for n in range(20)]
    assert not rules(run_with(join_spans(quick, early, OFFSET, 1)))


def test_a_server_clock_that_disagrees_silences_the_split() -> None:
    records = [record(n, 100, 60) for n in range(20)]
    # Every span begins 50 ms before its request was sent: another host's clock.
    spans = [cadence_like(n, 50, 0, 1, 1, 0.5) for n in range(20)]
    joined = join_spans(records, spans, OFFSET, 1)
    assert joined.clock_suspect == 20
    assert not rules(run_with(joined))
