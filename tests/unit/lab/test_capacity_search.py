"""`cadence capacity`'s search over scripted servers (issue 52): it says when the answer is the
edge of the range, confirms the knee with repeated runs and gives its spread, and never
answers above a load that failed."""

from __future__ import annotations

import random
from collections.abc import Callable

from cadence.lab.analysis.goodput import parse_term
from cadence.lab.capacity import CONFIRM_RUNS, search
from cadence.lab.report.capacity import answer_lines
from cadence.lab.results import BenchResult, Capacity, Distribution, Goodput, TermResult

SLO = [parse_term("ttft_p99_ms=100")]


def server(meets: Callable[[float, int], bool]) -> Callable[[float], BenchResult]:
    """A run at `value` meets the SLO when `meets(value, k)` (k: the runs at that value so
    far)."""
    seen: dict[float, int] = {}

    def run(value: float) -> BenchResult:
        k = seen[value] = seen.get(value, -1) + 1
        met = meets(value, k)
        ttft = 50.0 if met else 150.0
        return BenchResult(
            requests=16,
            requests_ok=16,
            ttft_ms=Distribution(count=16, mean=ttft, p50=ttft, p90=ttft, p99=ttft, max=ttft),
            goodput=Goodput(
                passed=met,
                terms={"ttft_p99_ms": TermResult(bound_ms=100, measured_ms=ttft, met=met)},
            ),
        )

    return run


def find(
    meets: Callable[[float, int], bool],
    low: float = 1,
    high: float = 256,
    kind: str = "concurrency",
) -> Capacity:
    return search(server(meets), kind, low, high, SLO, progress=lambda _: None)


def said(capacity: Capacity) -> str:
    return "\n".join(answer_lines(capacity))


def test_a_clean_knee_is_confirmed_with_repeated_runs_on_both_sides() -> None:
    found = find(lambda v, k: v <= 46)
    assert (found.max_passing, found.first_failing) == (46, 47)
    assert found.range_edge is None and found.non_monotone == []
    assert found.runs_by_value["46"] == [True] * CONFIRM_RUNS
    assert found.runs_by_value["47"] == [False] * CONFIRM_RUNS
    assert found.knee_spread == [46, 47] and found.confirm_runs == CONFIRM_RUNS
    assert "capacity: concurrency 46 meets the SLO (3 of 3 runs met it)" in said(found)


def test_a_range_whose_top_passes_says_at_least_and_raise_high() -> None:
    found = find(lambda v, k: True)
    assert found.max_passing == 256 and found.range_edge == "high"
    assert found.runs_by_value["256"] == [True] * CONFIRM_RUNS and found.runs_by_value["1"]
    assert "at least 256" in said(found) and "raise --high" in said(found)


def test_a_range_whose_bottom_fails_says_lower_low() -> None:
    found = find(lambda v, k: False, low=8)
    assert found.max_passing is None and found.range_edge == "low"
    assert "lower --low" in said(found)


def test_a_lucky_run_at_the_top_is_not_the_answer() -> None:
    """256 passes its first run only (the issue's `--high 256` answered 256 after one run,
    where the knee was 46): the repeats fail, and the search goes on down to the knee."""
    found = find(lambda v, k: v <= 46 or (v == 256 and k == 0))
    assert found.range_edge is None
    assert found.max_passing == 46
    assert found.runs_by_value["256"][0] and not all(found.runs_by_value["256"])
    # Runs met the SLO as high as 256 once: the spread says so.
    assert found.knee_spread == [46, 256]
    assert "runs disagree about the knee: it lies between 46 and 256" in said(found)


def test_a_passing_load_that_fails_on_a_repeat_sends_the_search_below_it() -> None:
    """47 passes its first run and fails its second: it is not the capacity."""
    found = find(lambda v, k: v <= 46 or (v == 47 and k == 0))
    assert (found.max_passing, found.first_failing) == (46, 47)
    assert found.runs_by_value["47"][:2] == [True, False]
    assert found.runs_by_value["46"] == [True] * CONFIRM_RUNS


def test_a_lower_load_failing_where_a_higher_passed_is_retried_and_reported() -> None:
    """The bottom of the range fails while its top passes: not answered by the top."""
    found = find(lambda v, k: v != 1)
    assert found.max_passing is None and found.range_edge is None
    assert len(found.runs_by_value["1"]) == CONFIRM_RUNS  # retried
    assert found.non_monotone == [[1, 256]]
    assert (
        "not monotone: concurrency 1 missed the SLO (0 of 3 runs met it) where 256 met it"
        in said(found)
    )


def test_two_searches_with_different_ranges_agree_within_their_spread() -> None:
    """A noisy knee: up to 46 every run passes, from 47 to 60 half of them, above none."""

    def noisy(seed: int) -> Callable[[float, int], bool]:
        rng = random.Random(seed)
        return lambda v, k: v <= 46 or (v <= 60 and rng.random() < 0.5)

    narrow = find(noisy(1), high=256)
    wide = find(noisy(2), high=1024)
    for found in (narrow, wide):
        assert found.range_edge is None and found.knee_spread
        assert 46 <= found.max_passing <= 60
    lo = max(narrow.knee_spread[0], wide.knee_spread[0])
    hi = min(narrow.knee_spread[1], wide.knee_spread[1])
    assert lo <= hi, (narrow.knee_spread, wide.knee_spread)  # the spreads overlap


def test_a_rate_search_confirms_its_knee_too() -> None:
    found = find(lambda v, k: v <= 38.0, low=10, high=80, kind="rate")
    assert found.max_passing <= 38.0 < found.first_failing <= 38.0 * 1.06
    assert len(found.runs_by_value[f"{found.max_passing:g}"]) == CONFIRM_RUNS
