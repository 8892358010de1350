"""A diagnosis rule: a name, a check over a run's facts, and the rules it gives way to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.results import Finding


def always(finding: Finding, facts: RunFacts) -> bool:
    return True


@dataclass(frozen=True)
class GiveWay:
    """A finding of this rule is dropped when rule `to` fired too and `when` holds: the other
    finding explains this one."""

    to: str
    when: Callable[[Finding, RunFacts], bool] = always


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[RunFacts], list[Finding]]
    """Findings from the evidence alone; [] where it is absent (the rule stays silent rather
    than guess)."""
    gives_way_to: tuple[GiveWay, ...] = ()
