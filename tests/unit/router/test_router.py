"""WorkerRouter (least outstanding work, round-robin ties) and AdmissionGate."""

from __future__ import annotations

from collections import Counter

import pytest

from cadence.router import AdmissionGate, WorkerRouter
from cadence.router.worker_router import NoWorkerAvailable

# -- WorkerRouter ---------------------------------------------------------------------------


def test_picks_least_loaded_worker():
    r = WorkerRouter(3)
    r.assign(0, 100)
    r.assign(1, 10)
    r.assign(2, 50)
    assert r.pick() == 1
    assert r.pick() == 1  # still the least loaded, whatever was picked last


def test_assign_and_release_track_load_and_requests():
    r = WorkerRouter(2)
    r.assign(1, 30)
    r.assign(1, 20)
    assert r.load == [0, 50] and r.requests == [0, 2]
    r.release(1, 30)
    assert r.load == [0, 20] and r.requests == [0, 1]
    r.assign(0, 40)
    assert r.pick() == 1
    r.release(0, 40)
    assert r.pick() == 0


def test_ties_spread_round_robin():
    r = WorkerRouter(3)
    assert [r.pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_ties_among_least_loaded_only_rotate_among_them():
    r = WorkerRouter(4)
    r.assign(1, 5)
    assert [r.pick() for _ in range(6)] == [0, 2, 3, 0, 2, 3]


def test_equal_requests_spread_evenly_when_assigned():
    r = WorkerRouter(4)
    picks = []
    for _ in range(40):
        w = r.pick()
        r.assign(w, 16)
        picks.append(w)
    assert Counter(picks) == {0: 10, 1: 10, 2: 10, 3: 10}
    assert r.load == [160] * 4


def test_skips_dead_workers_even_when_least_loaded():
    r = WorkerRouter(3)
    r.assign(1, 100)
    r.assign(2, 100)
    r.mark_dead(0)
    picks = {r.pick() for _ in range(6)}
    assert picks == {1, 2}


def test_raises_when_all_workers_dead():
    r = WorkerRouter(2)
    r.mark_dead(0)
    assert r.pick() == 1
    r.mark_dead(1)
    with pytest.raises(NoWorkerAvailable):
        r.pick()


def test_no_workers_at_all():
    with pytest.raises(NoWorkerAvailable):
        WorkerRouter(0).pick()


# -- AdmissionGate --------------------------------------------------------------------------


def test_gate_admits_up_to_limit_then_refuses():
    g = AdmissionGate(2)
    assert g.limit == 2
    assert g.try_enter()
    assert g.try_enter()
    assert g.active == 2
    assert not g.try_enter()
    assert g.active == 2  # a refusal takes nothing


def test_gate_leave_frees_a_slot():
    g = AdmissionGate(1)
    assert g.try_enter()
    assert not g.try_enter()
    g.leave()
    assert g.active == 0
    assert g.try_enter()
    assert not g.try_enter()


@pytest.mark.parametrize("limit", [0, -1])
def test_gate_limit_below_one_is_rejected(limit: int):
    with pytest.raises(ValueError, match="at least 1"):
        AdmissionGate(limit)
