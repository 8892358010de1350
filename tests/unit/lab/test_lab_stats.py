"""The lab's statistics on recorded timelines with known answers."""

from __future__ import annotations

import math

import msgspec
import pytest

from cadence.lab.analysis.stats import check_integrity, distribution, summarize
from cadence.lab.percentile import percentile
from cadence.lab.records import RequestRecord

MS = 1_000_000


def _record(arrivals_ms, tokens, *, start_ms=0.0, max_tokens=None, finish=1, code="OK", **timing):
    index, total = [], 0
    for n in tokens:
        index.append(total)
        total += n
    return RequestRecord(
        request_id="r",
        process=0,
        start_ns=int(start_ms * MS),
        end_ns=int(arrivals_ms[-1] * MS) if arrivals_ms else 0,
        code=code,
        max_tokens=total if max_tokens is None else max_tokens,
        finish_reason=finish,
        arrival_ns=[int(a * MS) for a in arrivals_ms],
        tokens=list(tokens),
        index=index,
        **timing,
    )


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 100) == 100
    assert percentile([7.0], 90) == 7.0
    assert math.isnan(percentile([], 50))
    d = distribution([3.0, 1.0, 2.0])
    assert (d.min, d.p50, d.max, d.mean, d.count) == (1.0, 2.0, 3.0, 2.0, 3)


def test_ttft_itl_tpot_and_e2e_from_a_known_timeline() -> None:
    # Sent at 0; chunks of 1, 1, 2 tokens arrive at 100, 120, 160 ms.
    result = summarize([_record([100, 120, 160], [1, 1, 2])])
    assert result.ttft_ms.p50 == pytest.approx(100)
    assert sorted([result.itl_ms.min, result.itl_ms.max]) == pytest.approx([20, 20])
    # The merged chunk's 40 ms gap counts once, divided by its 2 tokens.
    assert result.itl_ms.count == 2
    assert result.chunk_gap_ms.max == pytest.approx(40)
    assert result.tpot_ms.p50 == pytest.approx((160 - 100) / 3)
    assert result.e2e_ms.p50 == pytest.approx(160)
    assert result.chunk_tokens.mean == pytest.approx(4 / 3)
    assert result.output_tokens == 4


def test_errors_are_counted_by_code_and_left_out_of_latencies() -> None:
    records = [
        _record([10, 20], [1, 1]),
        _record([], [], code="RESOURCE_EXHAUSTED", finish=0),
        _record([], [], code="RESOURCE_EXHAUSTED", finish=0),
        _record([5], [1], code="DEADLINE_EXCEEDED", finish=0),
    ]
    result = summarize(records)
    assert result.errors_by_code == {"RESOURCE_EXHAUSTED": 2, "DEADLINE_EXCEEDED": 1}
    assert result.requests_ok == 1 and result.ttft_ms.count == 1


def test_integrity_counts_lost_repeated_reordered_and_short_streams() -> None:
    good = _record([1, 2], [1, 1])
    lost = _record([1, 2], [1, 1], max_tokens=4)
    lost.index = [0, 3]  # tokens 1 and 2 never came
    repeated = _record([1, 2, 3], [2, 2, 1], max_tokens=4)
    repeated.index = [0, 1, 3]  # token 1 came twice, in order
    swapped = _record([1, 2, 3], [1, 1, 1])
    swapped.index = [1, 0, 2]  # one reorder, nothing lost or repeated
    unfinished = _record([1], [1], finish=0)
    truncated = _record([1], [1], max_tokens=5)
    integrity = check_integrity([good, lost, repeated, swapped, unfinished, truncated])
    assert integrity.lost_tokens == 2 + 4
    assert integrity.repeated_tokens == 1
    assert integrity.reordered_chunks == 1
    assert integrity.short_streams == 2
    assert check_integrity([good]).lost_tokens == 0


def test_segments_add_up_to_ttft() -> None:
    # Sent 0, front 2, scheduled 5, step end 25, front read 26, send 28, arrival 30.
    r = _record(
        [30, 50],
        [1, 1],
        t_received_ns=2 * MS,
        t_scheduled_ns=5 * MS,
        t_step_start_ns=[5 * MS, 30 * MS],
        t_step_end_ns=[25 * MS, 45 * MS],
        t_front_recv_ns=[26 * MS, 47 * MS],
        t_send_ns=[28 * MS, 48 * MS],
    )
    result = summarize([r])
    seg = {k: v.p50 for k, v in msgspec.structs.asdict(result.ttft_segments_ms).items()}
    assert seg == pytest.approx(
        {"client_to_front": 2, "queue": 3, "first_step": 20, "transfer": 1, "buffer": 2, "send": 2}
    )
    assert sum(seg.values()) == pytest.approx(result.ttft_ms.p50)
    assert sum(result.segment_shares.ttft.values()) == pytest.approx(1)
    assert result.token_delay_ms.max == pytest.approx(5)  # 50 - 45
    assert result.segments_ms.engine_step.min == pytest.approx(15)


def test_connect_time_apart_from_ttft_for_http_records_only() -> None:
    opened = _record([30.0, 40.0], [1, 1], connect_ns=20 * MS)
    reused = _record([15.0, 25.0], [1, 1], connect_ns=0)
    stats = summarize([opened, reused])
    assert stats.connect_ms.count == 1 and stats.connect_ms.max == 20.0
    after = stats.ttft_after_connect_ms
    assert after.count == 2 and (after.min, after.max) == (10.0, 15.0)
    grpc = summarize([_record([30.0, 40.0], [1, 1])])  # connect_ns -1: not measured
    assert grpc.connect_ms is msgspec.UNSET and grpc.ttft_after_connect_ms is msgspec.UNSET


def test_a_record_without_a_connect_time_is_written_as_before_the_field_existed() -> None:
    from cadence.lab.results import BenchResult, to_builtins

    result = BenchResult(records=[_record([1.0], [1]), _record([1.0], [1], connect_ns=5)])
    unmeasured, measured = to_builtins(result)["records"]
    fields = RequestRecord.__struct_fields__.index("connect_ns") + 1
    # Neither a trace id nor a connect time: both left out (and every field after them).
    assert len(unmeasured) == fields - 2 and len(measured) == fields and measured[-1] == 5
    back = msgspec.convert(to_builtins(result), BenchResult).records
    assert [r.connect_ns for r in back] == [-1, 5]
