"""Rules on the shape of the streams, from client timestamps alone (any server, no server
timing): `output_held_back` (several tokens per message at a steady interval while the
client keeps up: output waits to be batched), `slow_stream_group` (a subset of the streams
consistently slower than the rest: one card or replica slower), and `slow_first_message`
(every stream waits long for its first message, the same whatever the load)."""

from __future__ import annotations

import statistics

from cadence.lab.analysis.diagnosis.client import CLIENT_BUSY_SHARE
from cadence.lab.analysis.diagnosis.facts import RunFacts, rounded
from cadence.lab.analysis.diagnosis.names import (
    RULE_KV_CACHE_FULL,
    RULE_OUTPUT_HELD_BACK,
    RULE_SERVER_QUEUE_GROWS,
    RULE_SLOW_FIRST_MESSAGE,
    RULE_SLOW_STREAM_GROUP,
    RULE_SLOW_WORKER,
    RULE_TTFT_SERVER_QUEUE,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.analysis.stats import is_ok, itl_points
from cadence.lab.results import Finding

HELD_TOKENS = 2.0
"""Messages carry this many tokens or more at the median: tokens are gathered before they go."""
STEADY_GAP_RATIO = 1.5
"""Gaps between messages at a steady interval: p90 within this factor of p50."""
MIN_GAP_MS = 5.0
"""...and at least this long (a real interval, not bytes split by the transport)."""

GROUP_RATIO = 1.5
"""Two speed groups: the slow group's median per-token gap this many times the fast group's."""
GROUP_SEPARATION = 1.25
"""...with no stream between them: the slow group's fastest stream this many times the fast
group's slowest."""
GROUP_MIN_SHARE = 0.1
"""Each group holds at least this share of the streams (and two streams)."""
MIN_STREAMS = 8
MIN_STREAM_TOKENS = 5

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
    result, gaps = facts.result, facts.gaps
    tokens = result.chunk_tokens
    if _timed_by_server(facts) or gaps is None or not tokens.count:
        return []  # cadence's own timing explains its merges (slow_reader)
    client_busy = result.client.busiest_process_cpu_share or 0.0
    if (tokens.p50 < HELD_TOKENS or gaps.p50 < MIN_GAP_MS
            or gaps.p90 > STEADY_GAP_RATIO * gaps.p50 or client_busy >= CLIENT_BUSY_SHARE):
        return []
    return [Finding(
        rule=RULE_OUTPUT_HELD_BACK,
        finding=(f"the server sends {tokens.p50:.0f} tokens per message (median), one message "
                 f"every {gaps.p50:.0f} ms at a steady interval, while the client keeps up: "
                 "tokens are held back to be sent together, so each waits for its batch, the "
                 "first token included"),
        evidence={"tokens_per_message_p50": rounded(tokens.p50, 1),
                  "tokens_per_message_mean": rounded(tokens.mean, 2),
                  "message_gap_p50_ms": rounded(gaps.p50),
                  "message_gap_p90_ms": rounded(gaps.p90),
                  "client_busiest_process_cpu_share": rounded(client_busy, 2)},
        look_at=("write each output unit to the stream as soon as it exists (one message per "
                 "token or per engine step); a send loop on a timer or a buffer that flushes "
                 "every N tokens adds up to one interval to every token's latency"),
    )]


def _per_stream_itl(facts: RunFacts) -> list[float]:
    records = facts.result.records or []
    out = []
    for r in records:
        if is_ok(r) and sum(r.tokens) >= MIN_STREAM_TOKENS:
            values = [itl for _, itl in itl_points(r)]
            if values:
                out.append(statistics.median(values))
    return out


def slow_stream_group(facts: RunFacts) -> list[Finding]:
    speeds = sorted(_per_stream_itl(facts))
    if len(speeds) < MIN_STREAMS:
        return []
    least = max(2, int(GROUP_MIN_SHARE * len(speeds) + 0.999))
    best = None
    for split in range(least, len(speeds) - least + 1):
        fast, slow = speeds[:split], speeds[split:]
        if fast[-1] > 0 and slow[0] / fast[-1] >= GROUP_SEPARATION:
            ratio = statistics.median(slow) / statistics.median(fast)
            if ratio >= GROUP_RATIO and (best is None or ratio > best[0]):
                best = (ratio, fast, slow)
    if best is None:
        return []
    ratio, fast, slow = best
    return [Finding(
        rule=RULE_SLOW_STREAM_GROUP,
        finding=(f"the streams fall into two speed groups: {len(slow)} of {len(speeds)} got "
                 f"their tokens {ratio:.1f} times slower (median per-token gap "
                 f"{statistics.median(slow):.1f} ms against {statistics.median(fast):.1f} ms), "
                 "with no stream in between: part of the streams is served by something slower"),
        evidence={"streams": len(speeds), "slow_streams": len(slow),
                  "slow_itl_p50_ms": rounded(statistics.median(slow)),
                  "fast_itl_p50_ms": rounded(statistics.median(fast)),
                  "fastest_slow_itl_ms": rounded(slow[0]), "slowest_fast_itl_ms": rounded(fast[-1])},
        look_at=("what serves that share of the streams: one card, replica or worker slower than "
                 "the others (clocks, thermal limits, a shared PCIe switch, another job on it), "
                 "or a load balancer that sends them elsewhere; compare the replicas' step times"),
    )]


def slow_first_message(facts: RunFacts) -> list[Finding]:
    ttft, gaps = facts.ttft, facts.gaps
    if _timed_by_server(facts) or ttft is None or gaps is None or gaps.p50 <= 0:
        return []  # with cadence's timing, ttft_engine_start splits the first step apart
    high = max(FIRST_GAPS * gaps.p50, FIRST_MIN_MS)
    even = ttft.p90 - ttft.min <= FIRST_EVEN_SHARE * ttft.p50
    if ttft.p50 < high or not even:
        return []
    return [Finding(
        rule=RULE_SLOW_FIRST_MESSAGE,
        finding=(f"every stream waited about {ttft.p50:.0f} ms for its first message (TTFT "
                 f"min {ttft.min:.0f}, p90 {ttft.p90:.0f} ms), {ttft.p50 / gaps.p50:.0f} times "
                 f"the gap between later messages ({gaps.p50:.1f} ms), and the wait does not "
                 "grow with the streams open: a fixed cost before each stream's first output"),
        evidence={"ttft_p50_ms": rounded(ttft.p50), "ttft_min_ms": rounded(ttft.min),
                  "ttft_p90_ms": rounded(ttft.p90), "gap_p50_ms": rounded(gaps.p50)},
        look_at=("what runs once per request before its first output: prefill of a long prompt, "
                 "a model or adapter loaded per request, the first card's scheduling or a cold "
                 "engine, a per-call set-up (authentication, a lookup); not the thread pool, "
                 "which would make the wait grow with the load"),
    )]


RULES = (
    Rule(RULE_OUTPUT_HELD_BACK, output_held_back),
    # With cadence's timing the slow worker itself is named.
    Rule(RULE_SLOW_STREAM_GROUP, slow_stream_group, gives_way_to=(GiveWay(RULE_SLOW_WORKER),)),
    # An even wait for the first message is the server's queue when its metrics or its own
    # spans show one (every stream of a closed loop waits about as long), not a fixed cost
    # per request.
    Rule(RULE_SLOW_FIRST_MESSAGE, slow_first_message,
         gives_way_to=(GiveWay(RULE_SERVER_QUEUE_GROWS), GiveWay(RULE_KV_CACHE_FULL),
                       GiveWay(RULE_TTFT_SERVER_QUEUE))),
)
