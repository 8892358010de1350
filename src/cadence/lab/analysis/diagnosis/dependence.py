"""Rules on what the latency depends on, from client timestamps alone (any server, any
protocol): `itl_depends_on` (the gaps between reads follow a variable of the run: their
position in the stream, the time in the run, the context in flight...) and `ttft_depends_on`
(the first outputs follow one: the prompt's length, the output budget, the order of
arrival...). Each names the variable, the shape and size of the dependence, what usually
makes it, and its share of the tail (`cadence.lab.analysis.dependence`)."""

from __future__ import annotations

from cadence.lab.analysis import dependence
from cadence.lab.analysis.diagnosis.coincidence import attribution
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import (
    RULE_ITL_DEPENDS_ON,
    RULE_TTFT_DEPENDS_ON,
    RULE_TTFT_GROWS_WITH_STREAMS,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.results import Finding


def tables(facts: RunFacts) -> dict[str, dependence.Table | None]:
    """The run's dependence tables, read once with its attribution (none without raw records
    or too few gaps to read)."""
    tail = attribution(facts)
    return tail.tables if tail is not None else {dependence.GAP: None, dependence.FIRST: None}


def _findings(facts: RunFacts, latency: str, rule: str) -> list[Finding]:
    table = tables(facts).get(latency)
    if table is None:
        return []
    key = "itl" if latency == dependence.GAP else "ttft"
    what = "gaps" if latency == dependence.GAP else "first outputs"
    out = []
    for d in table.named:
        evidence: dict = {
            "variable": d.variable,
            "shape": d.shape,
            "size": d.size,
            "strength": round(d.strength, 3),
            "values": d.values,
            "slow": table.slow,
            "slow_explained": d.slow_explained,
            f"{key}_tail_share": round(d.tail_share, 3),
            f"{key}_tail_ms": round(d.tail_ms, 1),
            f"{key}_tail_total_ms": round(table.tail_ms, 1),
            "goes_with": ", ".join(d.goes_with),
            "dependence": table.words(),
            **{k: v for k, v in d.evidence.items() if k != "p_value"},
            "p_value": d.evidence.get("p_value", d.p_value),
        }
        together = (
            f" ({', '.join(d.goes_with)} moved with it: the run cannot tell them apart)"
            if d.goes_with
            else ""
        )
        out.append(
            Finding(
                rule=rule,
                finding=(
                    f"The {what} depend on {d.variable} ({d.shape.replace('_', ' ')}): "
                    f"{d.size}{together}. It explains {d.tail_share:.0%} of the {what}' "
                    f"tail ({d.slow_explained} of {table.slow} slow)"
                ),
                evidence=evidence,
                look_at=(
                    f"what usually makes it: {d.cause}; to confirm, run again with "
                    f"{d.variable} held fixed or varied alone (cadence sweep)"
                ),
            )
        )
    return out


def itl_depends_on(facts: RunFacts) -> list[Finding]:
    return _findings(facts, dependence.GAP, RULE_ITL_DEPENDS_ON)


def ttft_depends_on(facts: RunFacts) -> list[Finding]:
    return _findings(facts, dependence.FIRST, RULE_TTFT_DEPENDS_ON)


_QUEUE_VARIABLES = frozenset({"waiting_at_send", "arrival_order", "streams_open_at_send"})
"""What `ttft_grows_with_streams` (streams opened together, taken in one at a time) is a
dependence on: the requests ahead of each one."""


def _the_queue(finding: Finding, facts: RunFacts) -> bool:
    """The dependence is the taught signature's own (its variable, or one the run cannot tell
    from it, is the requests ahead): the signature names it with its cause already."""
    table = tables(facts).get(dependence.FIRST)
    variable = finding.evidence["variable"]
    return any(
        {d.variable, *d.goes_with} & _QUEUE_VARIABLES
        for d in (table.named if table else ())
        if d.variable == variable
    )


RULES = (
    Rule(RULE_ITL_DEPENDS_ON, itl_depends_on),
    Rule(
        RULE_TTFT_DEPENDS_ON,
        ttft_depends_on,
        gives_way_to=(GiveWay(RULE_TTFT_GROWS_WITH_STREAMS, _the_queue),),
    ),
)
