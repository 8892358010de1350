"""The benchmark scripts that the README's figures come from still run (a benchmark that broke
with a change of the core would otherwise be found only when someone next measures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from tests.integration.conftest import start_server

_BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def _benchmark(script: str, *args: str, out: Path, timeout: float = 120) -> dict:
    """Run `benchmarks/SCRIPT ARGS --out OUT` and return the JSON it wrote."""
    subprocess.run(
        [sys.executable, str(_BENCHMARKS / script), *args, "--out", str(out)],
        capture_output=True,
        timeout=timeout,
        check=True,
    )
    return json.loads(out.read_text())


def test_chunk_path_measures_the_fronts_python_per_chunk() -> None:
    out = subprocess.run(
        [sys.executable, str(_BENCHMARKS / "chunk_path.py"), "--chunks", "200", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert json.loads(out)["ns_per_chunk_min"] > 0


def test_the_plain_reference_sends_the_timing_the_lab_asks_for() -> None:
    """The burst comparison reads where the reference's TTFT goes from the same timing fields
    as cadence's, so its chunks must carry them."""
    with start_server(
        "--port",
        "0",
        "--step-ms",
        "5",
        command=[sys.executable, str(_BENCHMARKS / "plain_grpc_reference.py")],
    ) as server:
        result = run_bench(
            server.target,
            Workload(requests=4, concurrency=4, warmup=0, shape=RequestShape(max_tokens=(6, 6))),
        )
    assert result.requests_ok == 4 and result.integrity.lost_tokens == 0
    assert result.segments_ms.client_to_front.count == 4
    assert 4.0 <= result.segments_ms.engine_step.p50 <= 6.0


@pytest.mark.slow
def test_the_transformers_engine_benchmark_runs(tmp_path) -> None:
    """Without `transformers serve`'s packages the peer is skipped, saying why."""
    out = tmp_path / "transformers_engine.json"
    result = _benchmark(
        "transformers_engine.py",
        "--workers",
        "1",
        "--streams",
        "2",
        "--requests-per-stream",
        "1",
        "--max-tokens",
        "4",
        out=out,
    )
    [row] = result["rows"]
    assert row["requests_ok"] == 2 and row["output_tokens"] == 8
    assert "fastapi" in result["skipped"]["transformers serve"]


def test_the_batched_side_by_side_benchmark_runs(tmp_path) -> None:
    """One small cadence row, and a peer without its venv skipped, saying why."""
    out = tmp_path / "side_by_side.json"
    result = _benchmark(
        "batched_side_by_side.py",
        "--only",
        "cadence step",
        "LitServe",
        "--streams",
        "2",
        "--max-tokens",
        "4",
        "--rounds",
        "1",
        "--open-s",
        "0",
        "--limit-steps",
        "2",
        "--venvs",
        str(tmp_path),
        out=out,
    )
    closed = [r for r in result["rows"] if r["loop"] == "closed"]
    assert {r["server"] for r in closed} == {"cadence step", "cadence step (OpenAI)"}
    assert all(r["requests_ok"] == 2 and r["output_tokens"] == 8 for r in closed)
    assert all(r["front_cpu_us_per_token"] is not None for r in closed)
    assert "litserve/bin/python is missing" in result["skipped"]["LitServe"]
    assert result["limit"]["start"][0]["batch"] == 1


def test_the_disaggregation_benchmark_runs(tmp_path) -> None:
    """One disaggregated setup at one load, and a sweep of one --disaggregate-above."""
    out = tmp_path / "disaggregation.json"
    result = _benchmark(
        "disaggregation.py",
        "--duration",
        "2",
        "--rates",
        "2",
        "--setups",
        "disaggregated 1+1",
        "--sweep",
        "0",
        out=out,
        timeout=180,
    )
    (setup,) = result["setups"]
    (load,) = setup["loads"]
    assert setup["workers"] == 2 and load["rate_per_s"] == 4
    assert load["requests_ok"] == load["requests"] > 0
    assert load["goodput"]["terms"].keys() == {"ttft_p99_ms", "itl_p99_ms"}
    (swept,) = result["sweep"]
    assert swept["disaggregate_above"] == 0 and swept["handed_off"] == swept["requests_ok"]
