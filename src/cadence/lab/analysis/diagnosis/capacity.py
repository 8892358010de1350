"""Rules on throughput: `under_capacity` (normal latency, but each engine step makes few
tokens: the server has room for more streams). It speaks only when nothing else is wrong, and
as information: a light load is a true statement about the run, not a fault of the server."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.facts import RunFacts, finite, rounded
from cadence.lab.analysis.diagnosis.itl import SLOW_READER_ITL_FACTOR
from cadence.lab.analysis.diagnosis.names import (
    RULE_CLIENT_BEHIND_SCHEDULE,
    RULE_CLIENT_SATURATED,
    RULE_FRONT_CPU_BOUND,
    RULE_FRONT_LOOP_BLOCKED,
    RULE_ITL_UNSTABLE_ENGINE,
    RULE_ITL_UNSTABLE_NETWORK,
    RULE_KV_CACHE_FULL,
    RULE_REQUESTS_FAILING,
    RULE_SERVER_QUEUE_GROWS,
    RULE_SLOW_READER,
    RULE_SLOW_WORKER,
    RULE_STREAMS_STALL_TOGETHER,
    RULE_TTFT_ENGINE_START,
    RULE_TTFT_GROWS_WITH_STREAMS,
    RULE_TTFT_QUEUEING,
    RULE_UNDER_CAPACITY,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.analysis.diagnosis.ttft import ttft_high
from cadence.lab.results import INFORMATION, Finding

UNDER_CAPACITY_BATCH = 4.0
"""Throughput is under capacity when each worker makes fewer than this many tokens per
engine step on average (tokens/s x step / workers): a decode step costs about the same for
1 or 8 sequences, so most of each step is wasted."""


def under_capacity(facts: RunFacts) -> list[Finding]:
    itl, ttft, typical = facts.itl, facts.ttft, facts.typical_step
    tokens_per_s = facts.result.tokens_per_s
    if not (itl and ttft and typical and facts.workers and finite(tokens_per_s)):
        return []
    # Latency is normal in its tail too: a p90 TTFT that waits for a place in the batch is a
    # server at its limit, not one with room to spare.
    if itl.p50 > SLOW_READER_ITL_FACTOR * typical or ttft_high(typical, ttft.p90):
        return []
    per_step = tokens_per_s * typical / 1e3 / len(facts.workers)
    if per_step >= UNDER_CAPACITY_BATCH:
        return []
    evidence: dict = {
        "tokens_per_worker_step": rounded(per_step),
        "tokens_per_s": rounded(tokens_per_s, 0),
        "workers": len(facts.workers),
        "engine_step_p50_ms": rounded(typical),
        "itl_p50_ms": rounded(itl.p50),
        "ttft_p50_ms": rounded(ttft.p50),
    }
    if facts.result.workload.concurrency is not None:
        evidence["concurrency"] = facts.result.workload.concurrency
    return [
        Finding(
            rule=RULE_UNDER_CAPACITY,
            finding=(
                f"latency is normal but each worker makes {per_step:.1f} tokens per engine "
                "step: the server has room for more streams"
            ),
            evidence=evidence,
            look_at="raise the concurrency (or the request rate) until latency starts to grow",
            severity=INFORMATION,
        )
    ]


_SOMETHING_WRONG = (
    RULE_REQUESTS_FAILING,
    RULE_TTFT_ENGINE_START,
    RULE_TTFT_QUEUEING,
    RULE_ITL_UNSTABLE_ENGINE,
    RULE_ITL_UNSTABLE_NETWORK,
    RULE_SLOW_READER,
    RULE_FRONT_CPU_BOUND,
    RULE_CLIENT_SATURATED,
    RULE_CLIENT_BEHIND_SCHEDULE,
    RULE_STREAMS_STALL_TOGETHER,
    RULE_TTFT_GROWS_WITH_STREAMS,
    RULE_FRONT_LOOP_BLOCKED,
    RULE_SLOW_WORKER,
    RULE_SERVER_QUEUE_GROWS,
    RULE_KV_CACHE_FULL,
)
"""More streams help only a server that is otherwise well: any of these explains the low
batch better."""

RULES = (
    Rule(
        RULE_UNDER_CAPACITY,
        under_capacity,
        gives_way_to=tuple(GiveWay(name) for name in _SOMETHING_WRONG),
    ),
)
