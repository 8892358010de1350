"""Integrity counted from positions: each fault once, under its own name (issue 36: a swap once
read "lost 1, repeated 1, reordered 1")."""

from __future__ import annotations

import random

import pytest

from cadence.lab.analysis.integrity import check_integrity, count_stream, events_against_usage
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
        return RequestRecord(
            request_id="r",
            process=0,
            start_ns=0,
            code=code,
            max_tokens=max_tokens,
            finish_reason=finish,
            arrival_ns=list(range(1, len(index) + 1)),
            tokens=tokens,
            index=index,
        )

    integrity = check_integrity(
        [
            record([0, 1, 3, 2], [1, 1, 1, 1], max_tokens=4),  # a swap
            record([0, 1], [1, 1], max_tokens=4),  # ended for its length 2 short
            record([0, 1], [1, 1], max_tokens=4, finish=0),  # no final chunk: short, none lost
            record([0, 2], [1, 1], max_tokens=4, code="UNAVAILABLE", finish=0),  # a hole
        ]
    )
    assert (
        integrity.lost_tokens,
        integrity.repeated_tokens,
        integrity.reordered_chunks,
        integrity.short_streams,
    ) == (2 + 1, 0, 1, 2)


def sse_record(
    events: int, usage: int | None, *, max_tokens: int = 10, finish: str = "length"
) -> RequestRecord:
    """An OpenAI stream from a server whose events carry no position: `events` text events,
    then a final event and, unless None, the usage, decoded as the load generator does."""
    from cadence.lab.load.openai_http import decode_events

    lines = [b'data: {"choices": [{"text": "x"}]}'] * events
    lines.append(b'data: {"choices": [{"text": "", "finish_reason": "%s"}]}' % finish.encode())
    if usage is not None:
        lines.append(b'data: {"choices": [], "usage": {"completion_tokens": %d}}' % usage)
    record = RequestRecord(
        request_id="r",
        process=0,
        start_ns=0,
        max_tokens=max_tokens,
        arrival_ns=list(range(1, len(lines) + 1)),
    )
    decode_events(record, lines, False)
    return record


def test_each_sse_text_event_is_one_position_and_usage_is_kept_beside_them() -> None:
    record = sse_record(5, 10)
    assert (record.tokens, record.index, record.usage_outputs) == ([1] * 5, [0, 1, 2, 3, 4], 10)
    assert sse_record(5, None).usage_outputs == -1
    # A usage of no outputs beside text is a server that does not count (LitServe's zeros),
    # not a count that makes every event extra; with no text it is a count like any other.
    assert sse_record(5, 0).usage_outputs == -1
    assert sse_record(0, 0, finish="stop").usage_outputs == 0


def test_sse_events_against_usage() -> None:
    assert events_against_usage(11, 10) == (1, 0)  # one event more than the server made
    assert events_against_usage(9, 10) == (0, 1)
    assert events_against_usage(10, 10) == (0, 0)

    def checked(*records: RequestRecord) -> tuple:
        i = check_integrity(list(records))
        return (
            i.extra_events,
            i.usage_above_events,
            i.usage_above_events_streams,
            i.lost_tokens,
            i.repeated_tokens,
            i.short_streams,
        )

    assert checked(sse_record(10, 10)) == (0, 0, 0, 0, 0, 0)  # whole
    assert checked(sse_record(11, 10)) == (1, 0, 0, 0, 0, 0)  # an event sent twice
    # One event missing, or one of two tokens: information, the stream not called short.
    assert checked(sse_record(9, 10)) == (0, 1, 1, 0, 0, 0)
    # A server that sends two tokens an event without saying so is not called broken.
    assert checked(sse_record(5, 10), sse_record(5, 10)) == (0, 10, 2, 0, 0, 0)
    # Its usage is its own count of the stream: short of max_tokens after a length finish.
    assert checked(sse_record(8, 8)) == (0, 0, 0, 0, 0, 1)
    assert checked(sse_record(8, 8, finish="stop")) == (0, 0, 0, 0, 0, 0)
    # Without usage the events alone against max_tokens: a duplicate ends past it (short),
    # a loss before it (lost, and short), as any stream numbered by the client.
    assert checked(sse_record(11, None)) == (0, 0, 0, 0, 0, 1)
    assert checked(sse_record(9, None)) == (0, 0, 0, 1, 0, 1)


def test_extra_events_are_counted_over_sse_only() -> None:
    from cadence.lab.analysis.integrity import counted_checks
    from cadence.lab.results import Workload

    assert "extra_events" in counted_checks(Workload(protocol="openai"))
    assert "extra_events" not in counted_checks(Workload(protocol="cadence"))
    assert "extra_events" not in counted_checks(Workload(protocol="kserve"))
