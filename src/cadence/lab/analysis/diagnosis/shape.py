"""Rules on the shape of the streams, from client timestamps alone (any server, any protocol,
no server timing): `output_held_back` (several outputs in one read or message at the engine's
pace while the client keeps up: output waits to be batched), `slow_stream_group` (a subset of
the streams consistently slower than the rest: one card or replica slower), and
`slow_first_message` (every stream pays a floor before its first output). Each reads its
signature and its share of the tail from `coincidence`; without the raw records
`output_held_back` falls back on the aggregates."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.client import CLIENT_BUSY_SHARE
from cadence.lab.analysis.diagnosis.coincidence import attribution, recognised
from cadence.lab.analysis.diagnosis.facts import RunFacts, rounded
from cadence.lab.analysis.diagnosis.names import (
    RULE_KV_CACHE_FULL,
    RULE_ONE_STREAM_AT_A_TIME,
    RULE_OUTPUT_HELD_BACK,
    RULE_SERVER_QUEUE_GROWS,
    RULE_SLOW_FIRST_MESSAGE,
    RULE_SLOW_STREAM_GROUP,
    RULE_SLOW_WORKER,
    RULE_TTFT_SERVER_QUEUE,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.analysis.diagnosis.signatures import FixedFirstCost, HeldBack, SlowGroup
from cadence.lab.results import Finding

HELD_TOKENS = 2.0
"""Without the raw records: messages carry this many tokens or more at the median..."""
STEADY_GAP_RATIO = 1.5
"""...at a steady interval: gaps between messages with p90 within this factor of p50..."""
MIN_GAP_MS = 5.0
"""...and at least this long (a real interval, not bytes split by the transport)."""

HELD_LOOK_AT = (
    "write each output unit to the stream as soon as it exists (one message or SSE "
    "event per token or per engine step, flushed): a buffered writer, a send loop "
    "on a timer or a buffer that flushes every N tokens adds up to N-1 steps to "
    "every token's latency"
)

FIXED_MIN_SHARE = 0.3
"""A fixed cost is also named when it explains at least this share of the first outputs'
tail time, however unevenly the rest of the wait spreads (a pool on top of a slow start)."""

FIRST_GAPS = 8.0
"""The first message waits this many typical gaps or more..."""
FIRST_MIN_MS = 100.0
"""...and this long (a busy host alone adds tens of ms before a stream's first message)..."""
FIRST_EVEN_SHARE = 0.5
"""...for every stream alike: TTFT p90 minus its minimum within this share of its p50 (a
wait that grew with the streams opened at once would spread)."""


def _timed_by_server(facts: RunFacts) -> bool:
    return bool(facts.result.segments_ms)


def output_held_back(facts: RunFacts) -> list[Finding]:
    if _timed_by_server(facts):
        return []  # cadence's own timing explains its merges (slow_reader)
    tail = attribution(facts)
    if tail is None:
        return _held_back_by_aggregates(facts)
    signature = tail.signature(HeldBack)
    if signature is None:
        return []
    ev = signature.evidence
    tokens = facts.result.chunk_tokens
    evidence = {**ev, **tail.shares(RULE_OUTPUT_HELD_BACK)}
    in_messages = tokens.count and tokens.p50 >= 2
    if tokens.count:
        evidence["tokens_per_message_p50"] = rounded(tokens.p50, 1)
        evidence["tokens_per_message_mean"] = rounded(tokens.mean, 2)
    client_busy = facts.result.client.busiest_process_cpu_share
    if client_busy is not None:
        evidence["client_busiest_process_cpu_share"] = rounded(client_busy, 2)
    where = (
        "in one message"
        if in_messages
        else "in one read (several messages or events written at once)"
    )
    shares = [
        f"{tail.itl_share(RULE_OUTPUT_HELD_BACK):.0%} of the gaps' tail"
        if tail.itl_ms.get(RULE_OUTPUT_HELD_BACK)
        else "",
        f"{tail.ttft_share(RULE_OUTPUT_HELD_BACK):.0%} of the first outputs' tail"
        if tail.ttft_ms.get(RULE_OUTPUT_HELD_BACK)
        else "",
    ]
    explains = " and ".join(x for x in shares if x)
    return [
        Finding(
            rule=RULE_OUTPUT_HELD_BACK,
            finding=(
                f"outputs arrive several at once: {ev['reads_with_several_share']:.0%} of "
                f"the reads carry two tokens or more ({ev['tokens_per_read_p50']:g} at the "
                f"median) {where}, at the engine's pace (a token every "
                f"{tail.reads.typical_ms:.1f} ms), while the client keeps up: the server "
                "holds outputs back and sends them together, so each waits for its batch, "
                "the first included" + (f"; this is {explains}" if explains else "")
            ),
            evidence=evidence,
            look_at=HELD_LOOK_AT,
        )
    ]


def _held_back_by_aggregates(facts: RunFacts) -> list[Finding]:
    """A result without its raw records: several tokens per message at a steady interval."""
    result, gaps = facts.result, facts.gaps
    tokens = result.chunk_tokens
    if gaps is None or not tokens.count:
        return []
    client_busy = result.client.busiest_process_cpu_share or 0.0
    if (
        tokens.p50 < HELD_TOKENS
        or gaps.p50 < MIN_GAP_MS
        or gaps.p90 > STEADY_GAP_RATIO * gaps.p50
        or client_busy >= CLIENT_BUSY_SHARE
    ):
        return []
    return [
        Finding(
            rule=RULE_OUTPUT_HELD_BACK,
            finding=(
                f"the server sends {tokens.p50:.0f} tokens per message (median), one message "
                f"every {gaps.p50:.0f} ms at a steady interval, while the client keeps up: "
                "tokens are held back to be sent together, so each waits for its batch, the "
                "first token included"
            ),
            evidence={
                "tokens_per_message_p50": rounded(tokens.p50, 1),
                "tokens_per_message_mean": rounded(tokens.mean, 2),
                "message_gap_p50_ms": rounded(gaps.p50),
                "message_gap_p90_ms": rounded(gaps.p90),
                "client_busiest_process_cpu_share": rounded(client_busy, 2),
            },
            look_at=HELD_LOOK_AT,
        )
    ]


def slow_stream_group(facts: RunFacts) -> list[Finding]:
    found = recognised(facts, SlowGroup)
    if found is None:
        return []
    tail, signature = found
    ev = signature.evidence
    explains = (
        f"; they hold {tail.itl_share(RULE_SLOW_STREAM_GROUP):.0%} of the gaps' tail"
        if tail.itl_ms.get(RULE_SLOW_STREAM_GROUP)
        else ""
    )
    return [
        Finding(
            rule=RULE_SLOW_STREAM_GROUP,
            finding=(
                f"the streams fall into two speed groups: {ev['slow_streams']} of "
                f"{ev['streams']} got their tokens {ev['slow_over_fast']:.1f} times slower "
                f"(median time per token {ev['slow_itl_p50_ms']:.1f} ms against "
                f"{ev['fast_itl_p50_ms']:.1f} ms, tokens that came together counted as one "
                "read), with no stream in between: part of the streams is served by "
                f"something slower{explains}"
            ),
            evidence={**ev, **tail.shares(RULE_SLOW_STREAM_GROUP)},
            look_at=(
                "what serves that share of the streams: one card, replica or worker slower than "
                "the others (clocks, thermal limits, a shared PCIe switch, another job on it), "
                "or a load balancer that sends them elsewhere; compare the replicas' step "
                "times (each replica's --scrape, or cadence's own timing, names it)"
            ),
        )
    ]


def slow_first_message(facts: RunFacts) -> list[Finding]:
    ttft, gaps = facts.ttft, facts.gaps
    if _timed_by_server(facts) or ttft is None or gaps is None:
        return []  # with cadence's timing, ttft_engine_start splits the first step apart
    tail = attribution(facts)
    typical = tail.reads.typical_ms if tail else gaps.p50
    if typical <= 0:
        return []
    high = max(FIRST_GAPS * typical, FIRST_MIN_MS)
    even = ttft.p90 - ttft.min <= FIRST_EVEN_SHARE * ttft.p50
    signature = tail.signature(FixedFirstCost) if tail else None
    share = tail.ttft_share(RULE_SLOW_FIRST_MESSAGE) if tail else 0.0
    floor = signature.evidence["ttft_floor_ms"] if signature else ttft.min
    alongside = signature is not None and floor >= high and share >= FIXED_MIN_SHARE
    if not ((ttft.p50 >= high and even) or alongside):
        return []
    evidence: dict[str, int | float | str | None] = {
        "ttft_p50_ms": rounded(ttft.p50),
        "ttft_min_ms": rounded(ttft.min),
        "ttft_p90_ms": rounded(ttft.p90),
        "gap_p50_ms": rounded(gaps.p50),
        "ttft_floor_ms": rounded(floor),
    }
    if tail:
        evidence.update(tail.shares(RULE_SLOW_FIRST_MESSAGE))
    spread = (
        "and the wait does not grow with the streams open"
        if even
        else f"and every stream pays it (the rest of the wait, up to {ttft.p90:.0f} ms at "
        "p90, has causes of its own)"
    )
    return [
        Finding(
            rule=RULE_SLOW_FIRST_MESSAGE,
            finding=(
                f"every stream waited at least about {floor:.0f} ms for its first message "
                f"(TTFT min {ttft.min:.0f}, p50 {ttft.p50:.0f}, p90 {ttft.p90:.0f} ms), "
                f"{floor / typical:.0f} times the typical gap between later outputs "
                f"({typical:.1f} ms), {spread}: a fixed cost before each stream's first "
                "output" + (f"; it is {share:.0%} of the first outputs' tail" if share else "")
            ),
            evidence=evidence,
            look_at=(
                "what runs once per request before its first output: prefill of a long prompt, "
                "a model or adapter loaded per request, the first card's scheduling or a cold "
                "engine, a per-call set-up (authentication, a lookup); not the thread pool, "
                "which would make the wait grow with the load"
            ),
        )
    ]


RULES = (
    Rule(RULE_OUTPUT_HELD_BACK, output_held_back),
    # With cadence's timing the slow worker itself is named.
    # Streams served in turn are slower while more are open: one_stream_at_a_time says why.
    Rule(
        RULE_SLOW_STREAM_GROUP,
        slow_stream_group,
        gives_way_to=(GiveWay(RULE_SLOW_WORKER), GiveWay(RULE_ONE_STREAM_AT_A_TIME)),
    ),
    # An even wait for the first message is the server's queue when its metrics or its own
    # spans show one (every stream of a closed loop waits about as long), not a fixed cost
    # per request.
    Rule(
        RULE_SLOW_FIRST_MESSAGE,
        slow_first_message,
        gives_way_to=(
            GiveWay(RULE_SERVER_QUEUE_GROWS),
            GiveWay(RULE_KV_CACHE_FULL),
            GiveWay(RULE_TTFT_SERVER_QUEUE),
        ),
    ),
)
