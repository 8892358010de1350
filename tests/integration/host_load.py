"""Lab tests on a host that another job loads: the lab's own `host_contended` finding says
when other work took the cores. A run without it is judged in full; a run with it must
still name its planted faults and give the host a part of every bad tail."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis import OTHERS_MIN_PCT, RULE_HOST_CONTENDED
from cadence.lab.results import BenchResult


def contended(result: BenchResult) -> bool:
    """Whether other work on the host took the cores this run needed (and the lab said so)."""
    found = [f for f in result.diagnosis if f.rule == RULE_HOST_CONTENDED]
    for finding in found:
        assert finding.evidence["others_cores"] >= OTHERS_MIN_PCT / 100, finding
    return bool(found)


def assert_tails_put_on_host(result: BenchResult) -> None:
    """On a contended host: the host is among the causes of every bad tail, and the output
    is whole with no request failed. (The host may stall a busy server longer than the
    probe's light thread waits, so part of a tail may stay `unexplained_tail`.)"""
    assert not result.verdict.problems, result.verdict.line
    for tail in result.verdict.tails:
        if tail.state == "bad":
            assert RULE_HOST_CONTENDED in tail.explained_by, result.verdict.line


def assert_named(result: BenchResult, expected: set[str], among: set[str] | None = None) -> None:
    """The run's findings (those in `among`, when given) are `expected`. On a contended host
    a planted fault must still be named (of two at once, one at least: the host's delays can
    hide the smaller one's pattern), and with nothing expected the bad tails go to the host."""
    fired = {f.rule for f in result.diagnosis}
    if among is not None:
        fired &= among
    if not contended(result):
        assert fired == expected, result.diagnosis
        return
    assert not expected or expected & fired, result.diagnosis
    if not expected:
        assert_tails_put_on_host(result)
