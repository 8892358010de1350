"""The rules on the output itself: `integrity_faults` (tokens lost, repeated or out of order,
streams that ended short, SSE events beyond the server's count, as
`cadence.lab.analysis.integrity` counts them): a run whose output is not whole is wrong whatever
its latencies say; `usage_above_events`, information: an SSE server's usage counts more
outputs than text events arrived."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import RULE_INTEGRITY_FAULTS, RULE_USAGE_ABOVE_EVENTS
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.analysis.integrity import CHECK_WORDS, count_stream, faults
from cadence.lab.results import INFORMATION, Finding

_LOOK_AT = {
    "lost_tokens": "outputs dropped between the engine and the stream (a queue that drops, "
    "an overflow policy, a hand-off that overwrites)",
    "repeated_tokens": "outputs sent twice (a retry that resends, a hand-off read twice)",
    "reordered_chunks": "outputs handed between threads or tasks without an order (a racy "
    "hand-off, one queue read by several senders)",
    "short_streams": "streams ended before their last output (an error swallowed, a "
    "length limit of the server's)",
    "extra_events": "text events sent beyond the server's own count of outputs (an event "
    "written twice: a retry that resends, a buffer flushed twice)",
}

_POSITIONS_FROM = {
    "cadence": "the server's index of each chunk",
    "grpc": "the server's --index-field",
    "openai": "the server's index where its events carry one, else the client's count",
    "kserve": "the client's count",
}
"""Where each protocol's positions come from: only a server's own numbering can show a
reorder, a loss or a repeat; the client's count shows short streams."""


def integrity_faults(facts: RunFacts) -> list[Finding]:
    result = facts.result
    found = faults(result.integrity, result.workload)
    if not found:
        return []
    evidence: dict = dict(found)
    positions = _POSITIONS_FROM.get(result.workload.protocol, "the client's count")
    evidence["positions_from"] = positions
    streams = [
        r
        for r in result.records or ()
        if (c := count_stream(r.index, r.tokens)).lost or c.repeated or c.reordered
    ]
    if result.records:
        evidence["streams_with_position_faults"] = len(streams)
        evidence["streams"] = len(result.records)
        if streams:
            evidence["first_such_request"] = streams[0].request_id
    counted = ", ".join(f"{CHECK_WORDS[name]} {count}" for name, count in found.items())
    return [
        Finding(
            rule=RULE_INTEGRITY_FAULTS,
            finding=(
                f"the output is not whole: {counted} (positions from {positions}); the "
                "latencies describe a stream that is wrong"
            ),
            evidence=evidence,
            look_at="; ".join(_LOOK_AT[name] for name in found),
        )
    ]


def usage_above_events(facts: RunFacts) -> list[Finding]:
    """Information, not a fault: an SSE server's usage counts more outputs than text events
    arrived. Several tokens an event is how some servers stream; a missing event looks the
    same where the events carry no position of the server's own."""
    integrity = facts.result.integrity
    streams = integrity.usage_above_events_streams
    if not streams:
        return []
    above = [r for r in facts.result.records or () if r.usage_outputs > len(r.tokens)]
    evidence: dict = {
        "usage_above_events": integrity.usage_above_events,
        "usage_above_events_streams": streams,
    }
    said = f"usage counts {integrity.usage_above_events} outputs more than the text events"
    if above:
        evidence.update(
            usage_outputs=sum(r.usage_outputs for r in above),
            text_events=sum(len(r.tokens) for r in above),
            first_such_request=above[0].request_id,
        )
        said = (
            f"usage counts {evidence['usage_outputs']} outputs where "
            f"{evidence['text_events']} text events arrived"
        )
    return [
        Finding(
            rule=RULE_USAGE_ABOVE_EVENTS,
            finding=(
                f"in {streams} streams the server's {said}: several tokens an event, or "
                "events missing (its events carry no position of its own, so which cannot "
                "be told); each event is counted as one output"
            ),
            evidence=evidence,
            look_at=(
                "whether the server sends several tokens an event (a stream interval, a "
                "detokenizer that holds back partial characters; --tokenizer then counts "
                "real tokens), else a writer that drops events"
            ),
            severity=INFORMATION,
        )
    ]


RULES = (
    Rule(RULE_INTEGRITY_FAULTS, integrity_faults),
    Rule(RULE_USAGE_ABOVE_EVENTS, usage_above_events),
)
