"""`cadence sweep --target`: the load of a server that is already running, swept as a grid,
the server left as it was; and a sweep whose every run fails exits non-zero."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from tests.integration.conftest import RunningServer, start_server


@pytest.fixture(scope="module")
def running() -> Iterator[RunningServer]:
    server = start_server("--devices", "cpu:2", "--step-ms", "5", "--max-tokens-limit", "16")
    yield server
    assert server.stop() == 0


def _sweep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cadence.cli", "sweep", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _pids(server: RunningServer) -> list[tuple[int, float]]:
    processes = [psutil.Process(server.process.pid), *server.workers]
    return sorted((p.pid, p.create_time()) for p in processes)


def test_a_grid_of_the_load_against_a_running_server(running, tmp_path) -> None:
    before = _pids(running)
    out, table = tmp_path / "sweep.json", tmp_path / "sweep.csv"
    done = _sweep(
        "--target",
        running.target,
        "--vary",
        "concurrency=1,4",
        "--vary",
        "max_tokens=4,8",
        "--requests",
        "4",
        "--json",
        str(out),
        "--csv",
        str(table),
    )
    assert done.returncode == 0, done.stderr
    # The same front and workers, none restarted, still serving.
    assert _pids(running) == before and running.process.poll() is None
    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["target"] == running.target and "serve_args" not in sweep
    assert sweep["variables"] == ["concurrency", "max_tokens"]
    values = [p["values"] for p in sweep["points"]]
    assert values == [{"concurrency": c, "max_tokens": m} for c in ("1", "4") for m in ("4", "8")]
    for point in sweep["points"]:
        (run,) = point["repeats"]
        assert not point["failed"] and run["requests_ok"] == 4
        assert run["workload"]["concurrency"] == int(point["values"]["concurrency"])
        assert run["output_tokens"] == 4 * int(point["values"]["max_tokens"])
    rows = list(csv.DictReader(table.open()))
    assert [(r["concurrency"], r["max_tokens"]) for r in rows] == [
        (v["concurrency"], v["max_tokens"]) for v in values
    ]
    assert all(float(r["ttft_p50_ms"]) > 0 and r["runs"] == "1" for r in rows)
    # Both varied columns in the terminal's table.
    assert "concurrency" in done.stdout and "max_tokens" in done.stdout


def test_a_point_whose_every_request_fails_is_marked_failed(running, tmp_path) -> None:
    out = tmp_path / "sweep.json"
    done = _sweep(
        "--target",
        running.target,
        "--vary",
        "max_tokens=4,64",
        "--requests",
        "2",
        "--concurrency",
        "2",
        "--json",
        str(out),
        "--csv",
        str(tmp_path / "s.csv"),
    )
    assert done.returncode == 0, done.stderr  # one point went through
    fine, refused = json.loads(out.read_text())["sweep"]["points"]
    assert not fine["failed"] and fine["repeats"][0]["requests_ok"] == 2
    assert refused["failed"] and refused["repeats"] == []
    assert "no request of 2 succeeded (2 INVALID_ARGUMENT" in refused["failures"][0]
    assert "--max-tokens-limit" in done.stdout


def test_a_sweep_whose_every_run_failed_exits_non_zero(tmp_path) -> None:
    gone = start_server("--devices", "cpu:1", "--step-ms", "5")
    assert gone.stop() == 0
    out = tmp_path / "sweep.json"
    done = _sweep(
        "--target", gone.target, "--vary", "concurrency=1,2", "--requests", "2", "--json", str(out)
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "cadence sweep: every run failed (2 of 2); each one's reason is above"
    )
    points = json.loads(out.read_text())["sweep"]["points"]
    assert all(p["failed"] and "no gRPC server answers" in p["failures"][0] for p in points)


def test_a_fresh_server_sweep_whose_servers_never_start_exits_non_zero() -> None:
    done = _sweep(
        "--serve-args", "--devices cpu:1 --no-such-flag", "--vary", "workers=1", "--requests", "1"
    )
    assert done.returncode != 0
    assert "every run failed (1 of 1)" in done.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--vary", "workers=1,2"], "with --serve-args or --server-cmd instead"),
        (["--vary", "concurrency=1,x"], "--vary concurrency=x: expected a whole number"),
        (["--vary", "concurrency=1", "--vary", "rate=2"], "do not combine"),
        (["--vary", "concurrency=1", "--vary", "concurrency=2"], "given twice"),
        (["--vary", "concurrency=1", "--serve-args", "--step-ms 5"], "one or the other"),
        (
            ["--vary", "concurrency=1", "--scrape", "http://127.0.0.1:1/metrics"],
            "--scrape http://127.0.0.1:1/metrics: ",
        ),
    ],
)
def test_a_sweep_of_a_running_server_refuses_in_one_line(args, said) -> None:
    done = _sweep("--target", "127.0.0.1:9", *args)
    assert done.returncode != 0 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("cadence sweep: ") and said in line, line
