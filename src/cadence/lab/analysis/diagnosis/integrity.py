"""The rule on the output itself: `integrity_faults` (tokens lost, repeated or out of order, or
streams that ended short, as `cadence.lab.analysis.integrity` counts them). A run whose output
is not whole is wrong whatever its latencies say."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import RULE_INTEGRITY_FAULTS
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.analysis.integrity import CHECK_WORDS, count_stream, faults
from cadence.lab.results import Finding

_LOOK_AT = {
    "lost_tokens": "outputs dropped between the engine and the stream (a queue that drops, "
                   "an overflow policy, a hand-off that overwrites)",
    "repeated_tokens": "outputs sent twice (a retry that resends, a hand-off read twice)",
    "reordered_chunks": "outputs handed between threads or tasks without an order (a racy "
                        "hand-off, one queue read by several senders)",
    "short_streams": "streams ended before their last output (an error swallowed, a "
                     "length limit of the server's)",
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
    streams = [r for r in result.records or ()
               if (c := count_stream(r.index, r.tokens)).lost or c.repeated or c.reordered]
    if result.records:
        evidence["streams_with_position_faults"] = len(streams)
        evidence["streams"] = len(result.records)
        if streams:
            evidence["first_such_request"] = streams[0].request_id
    counted = ", ".join(f"{CHECK_WORDS[name]} {count}" for name, count in found.items())
    return [Finding(
        rule=RULE_INTEGRITY_FAULTS,
        finding=(f"the output is not whole: {counted} (positions from {positions}); the "
                 "latencies describe a stream that is wrong"),
        evidence=evidence,
        look_at="; ".join(_LOOK_AT[name] for name in found),
    )]


RULES = (Rule(RULE_INTEGRITY_FAULTS, integrity_faults),)
