"""Rule on gaps that end on a clock rather than when output is ready, from client timestamps
alone: `gaps_at_fixed_values` (the slow gaps no other cause explains cluster sharply at one
value, whatever the step and at any position of the stream: a poll timeout, a flush or
heartbeat timer; gaps at the positions of a period of the stream are a wait every K tokens,
which `itl_depends_on` names, and are not read for a clock)."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.coincidence import recognised
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import RULE_GAPS_AT_FIXED_VALUES
from cadence.lab.analysis.diagnosis.rule import Rule
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


RULES = (Rule(RULE_GAPS_AT_FIXED_VALUES, gaps_at_fixed_values),)
