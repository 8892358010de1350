"""Integrity counted from positions: each fault once, under its own name (issue 36: a swap once
read "lost 1, repeated 1, reordered 1")."""

from __future__ import annotations

import random

import pytest

from cadence.lab.analysis.integrity import check_integrity, count_stream
from cadence.lab.records import RequestRecord


def counts(index: list[int], tokens: list[int] | None = None, until: int = 0) -> tuple:
    c = count_stream(index, tokens or [1] * len(index), until)
    return c.lost, c.repeated, c.reordered


def test_in_order_is_whole() -> None:
    assert counts([0, 1, 2, 3]) == (0, 0, 0)
    assert counts([0, 2, 5], [2, 3, 1]) == (0, 0, 0)
    assert counts([]) == (0, 0, 0)


def test_a_swap_of_two_outputs_is_one_reorder_and_nothing_else() -> None:
    assert counts([0, 1, 3, 2, 4]) == (0, 0, 1)
    assert counts([1, 0]) == (0, 0, 1)
    assert counts([0, 2, 1, 4, 3, 6, 5]) == (0, 0, 3)  # three swaps
    assert counts([0, 3, 1], [1, 2, 2]) == (0, 0, 1)  # chunks of several tokens


def test_one_output_moved_far_is_one_reorder() -> None:
    assert counts([0, 2, 3, 4, 5, 1]) == (0, 0, 1)  # arrived late
    assert counts([0, 5, 1, 2, 3, 4]) == (0, 0, 1)  # arrived early


def test_a_loss_is_lost_tokens_only() -> None:
    assert counts([0, 1, 3, 4]) == (1, 0, 0)
    assert counts([0, 1, 2], until=5) == (2, 0, 0)  # the end never came
    assert counts([0, 4], [1, 1]) == (3, 0, 0)
    assert counts([0, 1, 5], [1, 1, 0]) == (3, 0, 0)  # an empty final chunk says where it ended


def test_a_repeat_is_repeated_tokens_only() -> None:
    assert counts([0, 1, 1, 2]) == (0, 1, 0)
    assert counts([0, 1, 2, 1]) == (0, 1, 0)  # a late repeat is no reorder
    assert counts([0, 1, 3], [2, 2, 1]) == (0, 1, 0)  # overlapping chunks


def test_mixes_count_each_fault_once() -> None:
    # 0, 1, then 3 before 2 (a swap), 4 twice, 6 never.
    assert counts([0, 1, 3, 2, 4, 4, 5, 7]) == (1, 1, 1)
    # A chunk half new, half repeated, and out of order: its new half makes it a reorder.
    assert counts([0, 3, 2], [2, 2, 2]) == (0, 1, 1)


@pytest.mark.parametrize("seed", range(20))
def test_random_adjacent_swaps_are_counted_exactly(seed: int) -> None:
    rng = random.Random(seed)
    order, swaps, i = list(range(200)), 0, 0
    while i < len(order) - 1:
        if rng.random() < 0.2:
            order[i], order[i + 1] = order[i + 1], order[i]
            swaps += 1
            i += 2
        else:
            i += 1
    assert counts(order, until=200) == (0, 0, swaps)


def test_a_run_adds_up_its_streams_and_counts_short_streams() -> None:
    def record(index, tokens, *, max_tokens, finish=1, code="OK") -> RequestRecord:
        return RequestRecord(request_id="r", process=0, start_ns=0, code=code,
                             max_tokens=max_tokens, finish_reason=finish,
                             arrival_ns=list(range(1, len(index) + 1)), tokens=tokens,
                             index=index)

    integrity = check_integrity([
        record([0, 1, 3, 2], [1, 1, 1, 1], max_tokens=4),  # a swap
        record([0, 1], [1, 1], max_tokens=4),  # ended for its length 2 short
        record([0, 1], [1, 1], max_tokens=4, finish=0),  # no final chunk: short, none lost
        record([0, 2], [1, 1], max_tokens=4, code="UNAVAILABLE", finish=0),  # a hole
    ])
    assert (integrity.lost_tokens, integrity.repeated_tokens, integrity.reordered_chunks,
            integrity.short_streams) == (2 + 1, 0, 1, 2)
