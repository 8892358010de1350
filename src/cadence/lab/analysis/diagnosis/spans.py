"""Rules on the server's own spans joined to the requests (`--otlp-receive`): where TTFT is
spent on the server's clock, for any traced server. `ttft_before_server` (the time passes
before the server's span begins: network, proxy, the server's accept), `ttft_after_server`
(the server sent the first output long before the client read it) and `ttft_server_queue`
(the server's spans put the time in its queue)."""

from __future__ import annotations

from collections.abc import Callable

from cadence.lab.analysis.diagnosis.facts import RunFacts, rounded
from cadence.lab.analysis.diagnosis.names import (
    RULE_FRONT_LOOP_BLOCKED,
    RULE_KV_CACHE_FULL,
    RULE_SERVER_QUEUE_GROWS,
    RULE_TTFT_AFTER_SERVER,
    RULE_TTFT_BEFORE_SERVER,
    RULE_TTFT_QUEUEING,
    RULE_TTFT_SERVER_QUEUE,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.results import Distribution, Finding

OUTSIDE_SHARE = 0.5
"""A part "holds" TTFT from this share of TTFT's mean (the parts' means add up to it)."""
OUTSIDE_MIN_MS = 10.0
"""...and from this many ms: a millisecond on a local connection is not a finding."""
CLOCK_SUSPECT_SHARE = 0.1
"""From this share of requests whose server span began before they were sent, the server's
clock disagrees with this host's: before and after are not evidence."""


def _split(facts: RunFacts) -> dict[str, Distribution] | None:
    spans = facts.result.server_spans or None
    if spans is None or not spans.matched:
        return None
    if spans.clock_suspect > CLOCK_SUSPECT_SHARE * spans.matched:
        return None
    split = spans.ttft_split_ms
    return split if "before" in split else None


def _ttft_mean(split: dict[str, Distribution]) -> float:
    inside = ("inside", "after") if "inside" in split else ("inside_or_after",)
    return split["before"].mean + sum(split[name].mean for name in inside if name in split)


def _evidence(split: dict[str, Distribution], ttft: float) -> dict:
    out: dict = {"ttft_mean_ms": rounded(ttft)}
    for name, d in split.items():
        out[f"{name}_mean_ms"] = rounded(d.mean)
        out[f"{name}_p99_ms"] = rounded(d.p99)
    return out


def _holding(rule: str, part: str, says: str, look_at: str) -> Callable[[RunFacts], list[Finding]]:
    """The check of a rule that fires when `part` of the split holds TTFT (OUTSIDE_*): its
    finding is the part's share, then `says`."""

    def check(facts: RunFacts) -> list[Finding]:
        split = _split(facts)
        if split is None or part not in split:
            return []
        ttft, value = _ttft_mean(split), split[part].mean
        if not (ttft > 0 and value >= OUTSIDE_SHARE * ttft and value >= OUTSIDE_MIN_MS):
            return []
        return [
            Finding(
                rule=rule,
                finding=f"{value / ttft:.0%} of TTFT ({value:.1f} of {ttft:.1f} ms on average) {says}",
                evidence=_evidence(split, ttft),
                look_at=look_at,
            )
        ]

    return check


before_server = _holding(
    RULE_TTFT_BEFORE_SERVER,
    "before",
    "passes before the server's span for the request begins: the time is spent reaching the "
    "server's handler (the network, a proxy or load balancer, new connections, the server's "
    "accept queue), not in the server's handling",
    "what lies between client and server: proxies, TLS handshakes, new connections per "
    "request (reuse them), the server's listen backlog and accept loop, a busy or blocked "
    "event loop taking calls in",
)
after_server = _holding(
    RULE_TTFT_AFTER_SERVER,
    "after",
    "passes after the server says it sent the first output and before the client reads it: "
    "the output waits on its way (network, a buffering proxy, the server's send path past its "
    "instrumentation, or a busy client)",
    "proxies that buffer streamed responses (nginx proxy_buffering, X-Accel-Buffering), "
    "compression, HTTP/2 flow-control windows, the server's event loop between its handler "
    "and the socket, the client's CPU",
)
server_queue = _holding(
    RULE_TTFT_SERVER_QUEUE,
    "queue",
    "is time the server's own spans put in its queue, before a step took the request",
    "the server's batch limit and scheduling (max running requests, KV-cache room), or less "
    "load: `cadence capacity` finds how much meets the SLO",
)


RULES = (
    # With cadence's own timing, ttft_queueing says the same from the other side (reaching
    # the front), and a blocked front loop is why the calls were not taken in.
    Rule(
        RULE_TTFT_BEFORE_SERVER,
        before_server,
        gives_way_to=(GiveWay(RULE_FRONT_LOOP_BLOCKED), GiveWay(RULE_TTFT_QUEUEING)),
    ),
    Rule(RULE_TTFT_AFTER_SERVER, after_server),
    # The server's own metrics (--scrape) say why its queue grows: a full batch or KV cache.
    Rule(
        RULE_TTFT_SERVER_QUEUE,
        server_queue,
        gives_way_to=(
            GiveWay(RULE_TTFT_QUEUEING),
            GiveWay(RULE_SERVER_QUEUE_GROWS),
            GiveWay(RULE_KV_CACHE_FULL),
        ),
    ),
)
