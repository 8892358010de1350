"""The load generator's request shapes and open-loop schedule."""

from __future__ import annotations

import itertools
import statistics

import pytest

from cadence.lab.bench import Workload
from cadence.lab.load.plan import RequestShape, poisson_offsets
from cadence.lab.load.processes import ProcessPlan, _my_requests


def test_poisson_schedule_has_the_asked_rate_and_is_reproducible() -> None:
    offsets = list(itertools.islice(poisson_offsets(200.0, seed=7), 20_000))
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 200, rel=0.03)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / 200, rel=0.05)
    assert offsets == sorted(offsets)
    assert list(itertools.islice(poisson_offsets(200.0, seed=7), 50)) == offsets[:50]


def _plan(process: int, processes: int, **kw) -> ProcessPlan:
    return ProcessPlan(process=process, processes=processes, target="x", shape=RequestShape(),
                       **kw)


def test_processes_split_the_run_without_overlap_and_share_one_schedule() -> None:
    single = list(_my_requests(_plan(0, 1, requests=30, rate=50.0)))
    split = [list(_my_requests(_plan(p, 3, requests=30, rate=50.0))) for p in range(3)]
    assert sorted(i for part in split for i, _ in part) == list(range(30))
    assert sorted(x for part in split for x in part) == single


def test_duration_bounds_an_open_loop_run() -> None:
    sent = list(_my_requests(_plan(0, 1, requests=None, duration_s=2.0, rate=100.0)))
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
        ([1, 2], 5), ([3], 7), ([1, 2], 5)]


def test_a_run_must_be_bounded() -> None:
    with pytest.raises(ValueError, match="bound the run"):
        Workload(concurrency=4)
    with pytest.raises(ValueError, match="rate"):
        Workload(requests=4, rate=0)
