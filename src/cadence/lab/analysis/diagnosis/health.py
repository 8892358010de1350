"""Rules on the run's health: `requests_failing` (a share of the requests ended in an error).
The latency rules read the requests that succeeded; this one says how many did not."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.connection import refused_calls
from cadence.lab.analysis.diagnosis.facts import RunFacts, rounded
from cadence.lab.analysis.diagnosis.names import RULE_REQUESTS_FAILING, RULE_SERVER_STREAM_LIMIT
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.results import Finding

FAILING_SHARE = 0.01
"""Requests fail from this share of the run's requests: one error in a hundred is no noise
of the lab's (its client records every error), and a run that hides it is a run that lies."""

_CODE_HINTS = {
    "UNAVAILABLE": "the server went away or refused connections (did it exit or restart?)",
    "DEADLINE_EXCEEDED": "requests outlived --timeout: the server is overloaded or stalled",
    "RESOURCE_EXHAUSTED": "the server shed load (a full queue): lower the concurrency or rate",
    "CLIENT_ERROR": "the load generator failed to make or read requests (its message says how)",
}
"""What the common codes point at, for `look_at`."""


def requests_failing(facts: RunFacts) -> list[Finding]:
    result = facts.result
    failed = sum(result.errors_by_code.values())
    if not result.requests or failed < FAILING_SHARE * result.requests or not failed:
        return []
    codes = sorted(result.errors_by_code.items(), key=lambda item: -item[1])
    first_code = codes[0][0]
    first_message = result.first_error_by_code.get(first_code, "")
    evidence: dict = {
        "error_rate": rounded(failed / result.requests, 4),
        "requests": result.requests,
        "requests_failed": failed,
        **{f"errors_{code}": count for code, count in codes},
        "first_error": f"{first_code}: {first_message}",
    }
    if result.aborted:
        evidence["aborted"] = result.aborted
    counted = ", ".join(f"{code} {count}" for code, count in codes)
    hints = [_CODE_HINTS[code] for code, _ in codes if code in _CODE_HINTS]
    return [
        Finding(
            rule=RULE_REQUESTS_FAILING,
            finding=(
                f"{failed / result.requests:.0%} of the requests ({failed} of "
                f"{result.requests}) ended in an error ({counted}); the first {first_code}: "
                f"{first_message or '(no message)'}; the latencies are of the others only"
            ),
            evidence=evidence,
            look_at="; ".join([*hints, "the server's log at the first error's time"]),
        )
    ]


def _all_refused(finding: Finding, facts: RunFacts) -> bool:
    """Every failed call was refused by the server's stream limit: that limit is the finding."""
    return refused_calls(facts) == sum(facts.result.errors_by_code.values())


RULES = (
    Rule(
        RULE_REQUESTS_FAILING,
        requests_failing,
        gives_way_to=(GiveWay(RULE_SERVER_STREAM_LIMIT, _all_refused),),
    ),
)
