"""The rule on new requests holding the running streams: `arrivals_stall_streams` (the slow
gaps no other cause explains hold requests' sends far beyond chance: the server's handling of
each new call, its parsing, tokenizing or admitting, holds the loop or thread that sends the
others' tokens; `signatures.ArrivalStalls`)."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.coincidence import bad_tails, recognised
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import RULE_ARRIVALS_STALL_STREAMS
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.analysis.diagnosis.signatures import ArrivalStalls
from cadence.lab.results import Finding

ARRIVALS_MIN_SHARE = 0.2
"""The arrivals explain at least this share of an ITL tail the verdict judges bad."""


def arrivals_stall_streams(facts: RunFacts) -> list[Finding]:
    found = recognised(facts, ArrivalStalls, ARRIVALS_MIN_SHARE)
    if found is None or "itl_ms" not in bad_tails(facts):
        return []
    tail, signature = found
    e = signature.evidence
    return [
        Finding(
            rule=RULE_ARRIVALS_STALL_STREAMS,
            finding=(
                f"new requests hold the streams already running: {e['slow_gaps_holding_a_send']} "
                f"of the {e['slow_gaps_judged']} slow gaps no other cause explains had a request "
                f"sent inside them, where chance puts {e['slow_gaps_holding_a_send_by_chance']:g} "
                f"(p {e['sends_p']:.0e}); they hold {tail.itl_share(signature.rule):.0%} of the "
                "gaps' tail"
            ),
            evidence={**e, **tail.shares(signature.rule)},
            look_at=(
                "what the server does with each new call on the loop or thread that sends the "
                "running streams' tokens: request parsing and validation, tokenizing the "
                "prompt, admission or scheduling work, a queue both share; move that work off "
                "the sending path (a thread or process of its own), or admit new requests at "
                "step boundaries only. `--server-pid` (its threads, py-spy stacks) names it"
            ),
        )
    ]


RULES = (Rule(RULE_ARRIVALS_STALL_STREAMS, arrivals_stall_streams),)
