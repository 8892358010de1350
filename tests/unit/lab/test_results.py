"""The typed results read the JSON the lab wrote before they existed and write it back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from cadence.lab.results import BenchResult, Client, SweepResult, to_builtins

DATA = Path(__file__).parents[2] / "data"
BENCH_FIXTURES = sorted(p.name for p in DATA.glob("bench_result_*.json"))


def _text(obj) -> str:
    """NaN, key sets, values and int-versus-float all show in the text."""
    return json.dumps(obj, sort_keys=True)


def test_the_fixtures_cover_every_kind_of_run():
    assert {
        "bench_result_v0.json",
        "bench_result_baseline_v0.json",
        "bench_result_open_v0.json",
        "bench_result_grpc_v0.json",
        "bench_result_openai_v0.json",
        "bench_result_errors_v0.json",
    } <= set(BENCH_FIXTURES)


@pytest.mark.parametrize("name", BENCH_FIXTURES)
def test_a_bench_result_decodes_and_writes_back_the_same_json(name):
    written = json.loads((DATA / name).read_text())
    result = msgspec.convert(written, BenchResult)
    assert isinstance(result, BenchResult)
    assert _text(to_builtins(result)) == _text(written)


def test_a_sweep_result_decodes_and_writes_back_the_same_json():
    written = json.loads((DATA / "sweep_result_v0.json").read_text())
    result = msgspec.convert(written, SweepResult)
    assert result.sweep.points[0].repeats[0].records is msgspec.UNSET
    assert _text(to_builtins(result)) == _text(written)


def test_optional_keys_stay_absent_and_nulls_stay_null():
    grpc = msgspec.convert(
        json.loads((DATA / "bench_result_grpc_v0.json").read_text()), BenchResult
    )
    out = to_builtins(grpc)
    assert "segments_ms" not in out and "baseline" not in out and "openai" not in out["workload"]
    assert out["workers"] is None and out["workload"]["grpc"]["method"]


def test_a_failed_baseline_is_written_as_its_error_alone():
    result = msgspec.convert({"baseline": {"error": "no engine here"}}, BenchResult)
    assert to_builtins(result)["baseline"] == {"error": "no engine here"}


def test_the_client_s_schedule_fields_are_optional_and_kept_when_given():
    old = msgspec.convert({"processes": 1}, Client)
    assert not old.behind_schedule and "behind_schedule" not in msgspec.to_builtins(old)
    new = msgspec.convert(
        {
            "processes": 1,
            "behind_schedule": True,
            "offered_rate_per_s": None,
            "schedule_lag_ms": {
                "count": 3,
                "mean": 1.0,
                "p50": 1.0,
                "p90": 2.0,
                "p99": 2.0,
                "max": 2.0,
                "min": 0.5,
            },
        },
        Client,
    )
    assert new.behind_schedule is True and new.schedule_lag_ms.p90 == 2.0
    assert msgspec.to_builtins(new)["offered_rate_per_s"] is None
