"""The rule on the lab's own reading: `client_read_late` (a load process's event loop ran late
as slow gaps or first outputs ended, so the client stamped them late: part of a bad tail is
the lab's, not the server's; `signatures.ClientStalls`)."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.coincidence import bad_tails, recognised
from cadence.lab.analysis.diagnosis.facts import RunFacts, rounded
from cadence.lab.analysis.diagnosis.names import RULE_CLIENT_READ_LATE
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.analysis.diagnosis.signatures import ClientStalls
from cadence.lab.results import Finding

CLIENT_LATE_MIN_SHARE = 0.2
"""The client's late reads explain at least this share of a tail the verdict judges bad:
less is noise beside the tail's cause (and a healthy tail needs no excuse)."""


def client_read_late(facts: RunFacts) -> list[Finding]:
    found = recognised(facts, ClientStalls)
    if found is None:
        return []
    tail, signature = found
    shares = {"itl_ms": tail.itl_share(signature.rule), "ttft_ms": tail.ttft_share(signature.rule)}
    bad = [m for m in bad_tails(facts) if shares[m] >= CLIENT_LATE_MIN_SHARE]
    if not bad:
        return []
    client = facts.result.client
    evidence = {**signature.evidence, **tail.shares(signature.rule)}
    lag = client.loop_lag_ms or None
    if lag is not None and lag.usable:
        evidence["client_loop_lag_p99_ms"] = rounded(lag.p99)
    evidence["client_processes"] = client.processes
    words = " and ".join(
        f"{shares[m]:.0%} of the {'ITL' if m == 'itl_ms' else 'TTFT'} tail" for m in bad
    )
    return [
        Finding(
            rule=RULE_CLIENT_READ_LATE,
            finding=(
                f"the lab's own client read late: its load loop ran late "
                f"{signature.evidence['client_loop_stalls']} times (up to "
                f"{signature.evidence['client_loop_stall_max_ms']:.0f} ms) and the slow reads "
                f"that ended then hold {words}: those reads were stamped late by the client, "
                "not made late by the server"
            ),
            evidence=evidence,
            look_at=(
                "the load's client: a closed loop's wave of new requests made and sent at "
                "once, many chunks parsed together, or a client process waiting for a core; "
                "more client processes (--procs), a client on cores of its own (taskset) or "
                "on another host"
            ),
        )
    ]


RULES = (Rule(RULE_CLIENT_READ_LATE, client_read_late),)
