"""Rule on gaps that end on a clock rather than when output is ready, from client timestamps
alone: `gaps_at_fixed_values` (the slow gaps no other cause explains cluster sharply at one
value, whatever the step: a poll timeout, a flush or heartbeat timer)."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.coincidence import recognised
from cadence.lab.analysis.diagnosis.dependence import itl_depends_on
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import RULE_GAPS_AT_FIXED_VALUES, RULE_ITL_DEPENDS_ON
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.analysis.diagnosis.signatures import FixedGaps
from cadence.lab.results import Finding

TIMER_MIN_SHARE = 0.1
"""The timer is named when it explains at least this share of the gaps' tail time."""


def gaps_at_fixed_values(facts: RunFacts) -> list[Finding]:
    found = recognised(facts, FixedGaps, TIMER_MIN_SHARE)
    if found is None:
        return []
    tail, signature = found
    ev = signature.evidence
    gaps = ev["gap_value_ms"] / ev["typical_gap_ms"]
    return [
        Finding(
            rule=RULE_GAPS_AT_FIXED_VALUES,
            finding=(
                f"{ev['gaps_at_value']} slow gaps last {ev['gap_value_ms']:.0f} ms "
                f"(within {ev['tolerance_ms']:.1f} ms), {gaps:.0f} typical gaps, while only {ev['gaps_near_but_outside']} fall near that value: "
                f"these gaps end on a clock, not when output is ready. They explain "
                f"{tail.itl_share(RULE_GAPS_AT_FIXED_VALUES):.0%} of the gaps' tail"
            ),
            evidence={**ev, **tail.shares(RULE_GAPS_AT_FIXED_VALUES)},
            look_at=(
                f"a wait of {ev['gap_value_ms']:.0f} ms in the path from the engine to the "
                "stream: a poll timeout (queue.get(timeout=...), a condition wait with a "
                "timeout), a flush or heartbeat timer, a sleep in a loop; when only some gaps "
                "hit it, a wake-up is lost and the timeout catches it (a notify before the "
                "wait, an event cleared after it was set, a hand-off between threads "
                "without a lock)"
            ),
        )
    ]


def _gaps_at_fixed_positions(finding: Finding, facts: RunFacts) -> bool:
    """The slow gaps come every K positions of each stream (a per-block wait), not at any
    position on a clock: the dependence names them (issue 51)."""
    return any(
        f.rule == RULE_ITL_DEPENDS_ON and f.evidence.get("shape") == "periodic"
        for f in itl_depends_on(facts)
    )


RULES = (
    Rule(
        RULE_GAPS_AT_FIXED_VALUES,
        gaps_at_fixed_values,
        gives_way_to=(GiveWay(RULE_ITL_DEPENDS_ON, _gaps_at_fixed_positions),),
    ),
)
