"""The lab names what the latency depends on (issue 51), on engine-shaped planted servers
(tests/engine_shaped_servers.py: one engine loop stepping a batch of streams) whose faults
are written as their causes, not as the rules' shapes (tests/dependence_shapes.py): no KV
cache, a leak, prefill as the square of the prompt, a stream that waits out of the batch for
a new block every K tokens, a scheduler that admits the shortest output first, and two the
taught signatures were not written against (a front that waits for storage every K outputs,
a KV cache reserved per whole output). Each is run on gRPC with its first parameter set and
on OpenAI SSE with its second, and must be named by its variable and shape with a share of
its tail, and not by a taught signature it contradicts (a wait every K outputs is a
position, not a clock); clean servers whose steps jitter and whose lengths vary must name
none.

The taught signatures are held to the dependence: a clock beside a period keeps its own
gaps; a KV cache reserved per whole output starves the long requests by their length, which
a slot limit does not explain (the two never claim the same time); a plain slot limit is
still one. Each
run takes 2-8 s after the load generator's start (benchmarks/dependence_named.py runs them
many times and counts).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cadence.lab.analysis.diagnosis.names import (
    RULE_GAPS_AT_FIXED_VALUES,
    RULE_ITL_DEPENDS_ON,
    RULE_TTFT_DEPENDS_ON,
    RULE_TTFT_GROWS_WITH_STREAMS,
)
from cadence.lab.results import BenchResult
from tests.dependence_shapes import CLEAN, PLANTED, Planted, planted_period
from tests.integration.host_load import contended
from tests.integration.test_engine_shaped_diagnosis import Case, bench, explain

pytestmark = [pytest.mark.alone, pytest.mark.slow]

RUNS = [(name, front) for name in PLANTED for front in ("grpc", "sse")]


def _named(result: BenchResult, planted: Planted) -> dict:
    """The strongest finding of the planted cause's rule, held to its variable and shape."""
    found = [f for f in result.diagnosis if f.rule == planted.rule]
    assert found, explain(result)
    top = found[0].evidence
    if contended(result) and top["variable"] not in planted.variables:
        return top  # another job's stalls of the host can outweigh a planted slope
    assert top["variable"] in planted.variables, explain(result)
    assert top["shape"] in planted.shapes, explain(result)
    share = top["itl_tail_share" if planted.rule == RULE_ITL_DEPENDS_ON else "ttft_tail_share"]
    assert share >= 0.25, explain(result)
    assert top["size"] and "ms" in str(top["size"])
    return top


@pytest.mark.parametrize("name, front", RUNS, ids=[f"{n}-{f}" for n, f in RUNS])
def test_a_planted_dependence_is_named_by_its_variable_and_shape(name: str, front: str) -> None:
    planted = PLANTED[name]
    cases = planted.on(front)
    case = cases[0 if front == "grpc" else len(cases) - 1]
    result = bench(case)
    top = _named(result, planted)
    assert not planted.misnamed_by & {f.rule for f in result.diagnosis}, explain(result)
    if top["shape"] == "periodic":  # the planted K (a wait every K outputs)
        assert top["period"] == planted_period(case), explain(result)
    assert (
        planted.rule in result.verdict.line
        or result.verdict.state != "unhealthy"
        or any(planted.rule in t.explained_by for t in result.verdict.tails)
    ), result.verdict.line
    assert result.dependence, "the strongest dependence is kept for the report"
    kept = {c.latency: c for c in result.dependence}
    curve = kept["gap" if planted.rule == RULE_ITL_DEPENDS_ON else "ttft"]
    assert curve.named and curve.variable == top["variable"] and len(curve.x) >= 3


@pytest.mark.parametrize(
    "case",
    [CLEAN[0], replace(CLEAN[1], front="sse"), CLEAN[2]],
    ids=["grpc", "sse-2-cards", "grpc-slow"],
)
def test_a_clean_server_with_varied_lengths_depends_on_nothing(case: Case) -> None:
    result = bench(case)
    rules = {f.rule for f in result.diagnosis}
    assert not rules & {RULE_ITL_DEPENDS_ON, RULE_TTFT_DEPENDS_ON}, explain(result)


def test_a_clock_beside_a_period_keeps_its_own_gaps() -> None:
    """Lost wake-ups caught by a 50 ms poll (a clock, at any position) beside a 30 ms wait
    for a block every 16 tokens: both named, each with its share of the gaps' tail."""
    result = bench(
        Case(
            "grpc",
            (
                *("--lost-wakeup-share", "0.05", "--poll-ms", "50"),
                # A wait of 30 ms leaves the period about 40% of the gaps' tail beside the
                # clock's: a 20 ms one sat at the quarter a dependence needs to be named.
                *("--block-tokens", "16", "--block-ms", "30", "--decode-ms", "5"),
            ),
            frozenset(),
            max_tokens=(40, 80),
        )
    )
    found = {f.rule: f.evidence for f in result.diagnosis}
    if contended(result) and not {RULE_GAPS_AT_FIXED_VALUES, RULE_ITL_DEPENDS_ON} <= set(found):
        assert found.keys() & {RULE_GAPS_AT_FIXED_VALUES, RULE_ITL_DEPENDS_ON}, explain(result)
        return  # the host's own stalls can hide the smaller pattern
    assert found[RULE_ITL_DEPENDS_ON]["shape"] == "periodic", explain(result)
    assert 45 <= found[RULE_GAPS_AT_FIXED_VALUES]["gap_value_ms"] <= 60, explain(result)
    shares = [found[r]["itl_tail_share"] for r in (RULE_ITL_DEPENDS_ON, RULE_GAPS_AT_FIXED_VALUES)]
    assert min(shares) >= 0.1 and sum(shares) <= 1.1, explain(result)


def test_a_cache_reserved_per_whole_output_starves_by_length_not_by_slot() -> None:
    """A KV cache reserved for each stream's whole output, shortest first among those that
    fit: no cap on the count of streams, the long requests wait while short ones keep
    getting in. The first outputs follow max_tokens; what a slot could still claim is only
    what the length leaves (the two shares never count the same time twice), and with no
    cap seen on the streams receiving, no slot limit is named."""
    result = bench(
        Case(
            "grpc",
            ("--token-budget", "200", "--decode-ms", "4"),
            frozenset(),
            max_tokens=(8, 128),
        )
    )
    top = _named(
        result,
        Planted(RULE_TTFT_DEPENDS_ON, frozenset({"max_tokens"}), PLANTED["leak"].shapes, ()),
    )
    slot = next((f for f in result.diagnosis if f.rule == RULE_TTFT_GROWS_WITH_STREAMS), None)
    assert slot is None or contended(result), explain(result)
    if slot is not None:
        share = slot.evidence.get("ttft_tail_share") or 0.0
        assert share < top["ttft_tail_share"], explain(result)
        assert share + top["ttft_tail_share"] <= 1.05, explain(result)


def test_a_slot_limit_in_arrival_order_stays_a_slot_limit() -> None:
    """Four slots, first come first served, lengths that vary: the first outputs wait for
    those ahead of them, whatever their own size. The slot limit is named; no dependence on
    the request's own size claims it."""
    result = bench(
        Case(
            "grpc",
            ("--max-batch", "4", "--decode-ms", "4"),
            frozenset(),
            max_tokens=(8, 128),
            prompt_tokens=(10, 300),
        )
    )
    rules = {f.rule: f.evidence for f in result.diagnosis}
    assert RULE_TTFT_GROWS_WITH_STREAMS in rules, explain(result)
    own = rules.get(RULE_TTFT_DEPENDS_ON, {}).get("variable")
    assert own not in ("max_tokens", "prompt_tokens"), explain(result)
