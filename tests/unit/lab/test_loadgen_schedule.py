"""The load generator's request shapes, open-loop schedule (and how well it was kept), and
the rule that stops a failing run."""

from __future__ import annotations

import itertools
import statistics
import time

import pytest

from cadence.lab.analysis.schedule import schedule
from cadence.lab.bench import Workload
from cadence.lab.load.plan import RequestShape, poisson_offsets
from cadence.lab.load.processes import FailureStreak, ProcessPlan, my_requests
from cadence.lab.records import ProcessResult, RequestRecord
from cadence.lab.results import Client


def test_poisson_schedule_has_the_asked_rate_and_is_reproducible() -> None:
    offsets = list(itertools.islice(poisson_offsets(200.0, seed=7), 20_000))
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 200, rel=0.03)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / 200, rel=0.05)
    assert offsets == sorted(offsets)
    assert list(itertools.islice(poisson_offsets(200.0, seed=7), 50)) == offsets[:50]


def _plan(process: int, processes: int, **kw) -> ProcessPlan:
    return ProcessPlan(process=process, processes=processes, target="x", shape=RequestShape(), **kw)


def test_processes_split_the_run_without_overlap_and_share_one_schedule() -> None:
    single = list(my_requests(_plan(0, 1, requests=30, rate=50.0)))
    split = [list(my_requests(_plan(p, 3, requests=30, rate=50.0))) for p in range(3)]
    assert sorted(i for part in split for i, _ in part) == list(range(30))
    assert sorted(x for part in split for x in part) == single


def test_duration_bounds_an_open_loop_run() -> None:
    sent = list(my_requests(_plan(0, 1, requests=None, duration_s=2.0, rate=100.0)))
    assert all(offset <= 2.0 for _, offset in sent)
    assert 140 < len(sent) < 260


def test_request_shape_is_deterministic_and_within_bounds() -> None:
    shape = RequestShape(prompt_tokens=(3, 9), max_tokens=(10, 20), seed=1)
    requests = [shape.request(i) for i in range(200)]
    assert requests == [shape.request(i) for i in range(200)]
    assert {len(r.prompt_token_ids) for r in requests} == set(range(3, 10))
    assert min(r.max_tokens for r in requests) >= 10 and max(r.max_tokens for r in requests) <= 20
    fixed = RequestShape(prompts=[([1, 2], 5), ([3], 0)], max_tokens=(7, 7))
    assert [(r.prompt_token_ids, r.max_tokens) for r in map(fixed.request, range(3))] == [
        ([1, 2], 5),
        ([3], 7),
        ([1, 2], 5),
    ]


def test_a_run_must_be_bounded() -> None:
    with pytest.raises(ValueError, match="bound the run"):
        Workload(concurrency=4)
    with pytest.raises(ValueError, match="rate"):
        Workload(requests=4, rate=0)


def _sent(lags_ms: list[float], gap_s: float) -> ProcessResult:
    """A process that sent one request every `gap_s`, each `lags_ms[k]` late."""
    records = [
        RequestRecord(request_id=str(k), process=0, start_ns=int((k + 1) * gap_s * 1e9 + lag * 1e6))
        for k, lag in enumerate(lags_ms)
    ]
    return ProcessResult(0, records, 0.0, 1.0, 0, 0, lags_ms)


def test_a_client_on_its_schedule_is_not_behind() -> None:
    figures = schedule(100.0, [_sent([0.2] * 50, 0.01)])
    assert figures["offered_rate_per_s"] == 100.0
    assert figures["achieved_rate_per_s"] == pytest.approx(100.0, rel=0.01)
    assert figures["schedule_lag_ms"].count == 50
    assert figures["behind_schedule"] is False


def test_a_client_late_by_more_than_a_gap_for_a_tenth_of_its_requests_is_behind() -> None:
    late = [0.2] * 40 + [25.0] * 10  # a fifth of the requests 25 ms late, the gap 10 ms
    assert schedule(100.0, [_sent(late, 0.01)])["behind_schedule"] is True
    few = [0.2] * 48 + [25.0] * 2  # a few late ones: jitter, not a client behind
    assert schedule(100.0, [_sent(few, 0.01)])["behind_schedule"] is False


def test_a_closed_loop_has_no_schedule() -> None:
    assert schedule(None, [_sent([], 0.01)]) == {
        "offered_rate_per_s": None,
        "achieved_rate_per_s": None,
        "schedule_lag_ms": None,
        "behind_schedule": False,
    }


def _failed(code: str = "UNAVAILABLE") -> RequestRecord:
    return RequestRecord(request_id="r", process=0, start_ns=0, code=code, error="gone\nmore")


def test_a_failure_streak_stops_a_run_only_when_long_and_quiet() -> None:
    quick = FailureStreak(started=time.monotonic())
    for _ in range(FailureStreak.FAILURES * 3):
        quick.add(_failed())
    assert quick.reason is None  # many failures, but within the quiet time: a blip
    quiet = FailureStreak(started=time.monotonic() - FailureStreak.QUIET_S)
    for _ in range(FailureStreak.FAILURES - 1):
        quiet.add(_failed())
    assert quiet.reason is None  # quiet long enough, but not failures enough
    quiet.add(_failed())
    assert quiet.reason == (
        f"stopped early: {FailureStreak.FAILURES} requests in a row failed "
        f"and none succeeded for {FailureStreak.QUIET_S:.1f} s (last: "
        "UNAVAILABLE: gone)"
    )


def test_a_success_resets_the_failure_streak() -> None:
    streak = FailureStreak(started=time.monotonic() - FailureStreak.QUIET_S)
    for _ in range(FailureStreak.FAILURES - 1):
        streak.add(_failed())
    streak.add(RequestRecord(request_id="ok", process=0, start_ns=0))
    for _ in range(FailureStreak.FAILURES):
        streak.add(_failed())
    assert streak.reason is None


def test_the_summary_says_when_the_client_fell_behind() -> None:
    from cadence.lab.report.summary import schedule_line

    def client(figures: dict) -> Client:
        return Client(**figures)

    late = client(schedule(100.0, [_sent([0.2] * 40 + [25.0] * 10, 0.01)]))
    assert "fell behind its schedule" in schedule_line(late)
    kept = client(schedule(100.0, [_sent([0.2] * 50, 0.01)]))
    assert schedule_line(kept).startswith("open loop: offered 100 requests/s, achieved 100.0")
    assert "fell behind" not in schedule_line(kept)
    assert schedule_line(client(schedule(None, []))) is None
    assert schedule_line(Client()) is None  # a result saved before the schedule was measured
