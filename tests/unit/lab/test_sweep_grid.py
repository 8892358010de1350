"""`cadence sweep`'s grid: every combination of the varied values, each with its load."""

from __future__ import annotations

import csv

import msgspec
import pytest

from cadence.lab.bench import Workload
from cadence.lab.results import BenchResult, Sweep, SweepPoint, SweepResult
from cadence.lab.sweep import Load, grid, parse_vary, sweep_table, write_csv

BASE = Load(Workload(requests=8, concurrency=2))


def test_every_combination_first_axis_slowest_each_with_its_load() -> None:
    points = grid(
        [("concurrency", ["1", "4"]), ("max_tokens", ["8", "2:6"]), ("procs", ["2"])], BASE
    )
    assert [p.values for p in points] == [
        {"concurrency": c, "max_tokens": m, "procs": "2"} for c in ("1", "4") for m in ("8", "2:6")
    ]
    last = points[-1].load
    assert last.workload.concurrency == 4 and last.workload.shape.max_tokens == (2, 6)
    assert last.processes == 2 and last.workload.requests == 8
    assert BASE.workload.shape.max_tokens == (128, 128)  # the base is left as it was


def test_a_server_variable_changes_no_load() -> None:
    (point,) = grid([("workers", ["2"])], BASE)
    assert point == ({"workers": "2"}, BASE)


@pytest.mark.parametrize(
    ("axes", "said"),
    [
        ([("rate", ["-1"])], "--vary rate=-1: expected a number of at least 0"),
        ([("requests", ["0"])], "--vary requests=0: expected a whole number of at least 1"),
        ([("max_tokens", ["9:2"])], "--vary max_tokens=9:2: expected 1 <= LO <= HI"),
        ([("rate", ["1"]), ("concurrency", ["2"])], "do not combine"),
    ],
)
def test_a_grid_that_cannot_run_is_refused_before_anything_runs(axes, said) -> None:
    with pytest.raises(ValueError, match=said):
        grid(axes, BASE)


def test_a_running_server_varies_only_the_load() -> None:
    assert parse_vary("max-tokens=4,8", running=True) == ("max_tokens", ["4", "8"])
    with pytest.raises(ValueError, match="--serve-args or --server-cmd instead"):
        parse_vary("step_ms=5", running=True)
    with pytest.raises(ValueError, match="cannot vary 'threads'"):
        parse_vary("threads=2", running=True)
    assert parse_vary("max-tokens=4", "serve --port {port}") == ("max_tokens", ["4"])


def test_the_csv_has_a_row_per_point_failed_ones_without_figures(tmp_path) -> None:
    run = msgspec.convert(
        {
            "ttft_ms": {"p50": 10.0, "p99": 20.0},
            "itl_ms": {"mean": 5.0, "p90": 6.0},
            "tokens_per_s": 100.0,
            "diagnosis": [{"rule": "under_capacity", "finding": "", "evidence": {}, "look_at": ""}],
        },
        BenchResult,
    )
    points = [
        SweepPoint(
            value="1,4",
            values={"concurrency": "1", "max_tokens": "4"},
            repeats=[run, run],
            failed=False,
        ),
        SweepPoint(
            value="2,4",
            values={"concurrency": "2", "max_tokens": "4"},
            repeats=[],
            failed=True,
            failures=["nothing answers"],
        ),
    ]
    sweep = SweepResult(
        sweep=Sweep(
            variable="concurrency,max_tokens",
            variables=["concurrency", "max_tokens"],
            points=points,
            table=sweep_table(points),
        )
    )
    write_csv(sweep, tmp_path / "s.csv")
    ok, failed = csv.DictReader((tmp_path / "s.csv").open())
    assert (ok["concurrency"], ok["runs"], ok["failed_runs"]) == ("1", "2", "0")
    assert float(ok["ttft_p99_ms"]) == 20.0 and ok["diagnosis"] == "under_capacity"
    assert (failed["concurrency"], failed["runs"], failed["failed_runs"]) == ("2", "0", "1")
    assert failed["ttft_p50_ms"] == "" and failed["diagnosis"] == ""
