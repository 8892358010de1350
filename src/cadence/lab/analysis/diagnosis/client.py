"""Rules on the load generator itself: `client_saturated` (a client process near a full
core) and `client_behind_schedule` (an open loop that could not send on time). Either makes
the run's figures the client's as much as the server's."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.facts import RunFacts, finite, rounded
from cadence.lab.analysis.diagnosis.host import BUSY_CPU_PCT
from cadence.lab.analysis.diagnosis.names import (
    RULE_CLIENT_BEHIND_SCHEDULE,
    RULE_CLIENT_SATURATED,
)
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.results import Finding

CLIENT_BUSY_SHARE = 0.8
"""A load-generating process spending this share of its wall time on CPU measures itself."""


def saturated(facts: RunFacts) -> list[Finding]:
    client = facts.result.client
    share = client.busiest_process_cpu_share
    evidence: dict = {}
    if finite(share) and share >= CLIENT_BUSY_SHARE:
        evidence["busiest_process_cpu_share"] = rounded(share, 3)
    for name in sorted(n for n in facts.result.system.processes if n.startswith("client")):
        pct = facts.active_cpu(name)
        if pct is not None and pct >= BUSY_CPU_PCT:
            evidence[f"{name}_cpu_pct"] = rounded(pct, 1)
    if not evidence:
        return []
    if finite(client.cpu_per_chunk_us):
        evidence["cpu_per_chunk_us"] = rounded(client.cpu_per_chunk_us, 0)
    evidence["client_processes"] = client.processes
    return [
        Finding(
            rule=RULE_CLIENT_SATURATED,
            finding=(
                "a load-generating process is near a full core: the numbers measure the "
                "client as much as the server"
            ),
            evidence=evidence,
            look_at="add client processes (--procs) or channels, or run the client elsewhere",
        )
    ]


def behind_schedule(facts: RunFacts) -> list[Finding]:
    client = facts.result.client
    if client.behind_schedule is not True:
        return []
    evidence: dict = {"schedule_slips": client.schedule_slips}
    for name in ("offered_rate_per_s", "achieved_rate_per_s"):
        value = getattr(client, name)
        if finite(value):
            evidence[name] = rounded(value)
    lag = client.schedule_lag_ms
    lagging = ""
    if lag and lag.usable:
        evidence["schedule_lag_p50_ms"] = rounded(lag.p50)
        evidence["schedule_lag_p99_ms"] = rounded(lag.p99)
        evidence["schedule_lag_max_ms"] = rounded(lag.max)
        lagging = f", sending up to {lag.max:.0f} ms late (p99 {lag.p99:.0f} ms)"
    rates = ""
    if "offered_rate_per_s" in evidence and "achieved_rate_per_s" in evidence:
        rates = (
            f": it sent {evidence['achieved_rate_per_s']:g} requests/s of the "
            f"{evidence['offered_rate_per_s']:g} asked for"
        )
    return [
        Finding(
            rule=RULE_CLIENT_BEHIND_SCHEDULE,
            finding=(
                f"the client fell behind its open-loop schedule{rates}{lagging}; the "
                "arrival rate and the latencies are the client's, not the server's"
            ),
            evidence=evidence,
            look_at=(
                "add client processes (--procs) or run the client on another machine, or "
                "lower --rate; check the client's CPU (client_saturated)"
            ),
        )
    ]


RULES = (
    Rule(RULE_CLIENT_SATURATED, saturated),
    Rule(RULE_CLIENT_BEHIND_SCHEDULE, behind_schedule),
)
