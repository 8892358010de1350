"""`cadence report a.json b.json`: runs side by side with ratios, and --fail-if gates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from cadence.cli import main
from cadence.lab.report.compare import metric, parse_gate, rows
from cadence.lab.results import BenchResult

DATA = Path(__file__).resolve().parents[2] / "data"
BASE = DATA / "bench_result_v0.json"


def load(path: Path) -> BenchResult:
    data = json.loads(path.read_text())
    data.pop("records", None)
    return msgspec.convert(data, BenchResult)


def slower(tmp_path: Path, factor: float) -> Path:
    """The base run with every TTFT statistic `factor` times larger."""
    data = json.loads(BASE.read_text())
    data["ttft_ms"] = {k: v * factor if k != "count" else v for k, v in data["ttft_ms"].items()}
    path = tmp_path / f"slower-{factor}.json"
    path.write_text(json.dumps(data))
    return path


def test_metrics_and_ratios() -> None:
    base = load(BASE)
    assert metric(base, "ttft_p99_ms") == base.ttft_ms.p99
    assert metric(base, "e2e_max_ms") == base.e2e_ms.max
    assert metric(base, "errors") == 0.0
    [row] = rows([base, base], names=("ttft_p99_ms",))
    assert row[0] == "ttft_p99_ms" and row[2].endswith("(1.00x)")
    with pytest.raises(ValueError, match="unknown metric 'ttft_p98_ms'"):
        metric(base, "ttft_p98_ms")


def test_gates() -> None:
    base = load(BASE)
    gate = parse_gate("ttft_p99_ms>1.1x")
    assert gate.failure(base, base, "b") is None
    worse = msgspec.structs.replace(
        base, ttft_ms=msgspec.structs.replace(base.ttft_ms, p99=base.ttft_ms.p99 * 1.2)
    )
    assert "ttft_p99_ms>1.1x failed" in gate.failure(base, worse, "b")
    assert parse_gate("errors>0").failure(base, base, "b") is None
    assert parse_gate("tokens_per_s<2x").failure(base, base, "b") is not None
    for bad in ("ttft_p99_ms>=1.1x", "ttft>1", "ttft_p98_ms>1x"):
        with pytest.raises(ValueError):
            parse_gate(bad)


def test_the_command_exits_non_zero_on_a_failed_gate(tmp_path, capsys) -> None:
    ok = slower(tmp_path, 1.05)
    main(["report", str(BASE), str(ok), "--fail-if", "ttft_p99_ms>1.1x"])
    assert "(1.05x)" in capsys.readouterr().out
    bad = slower(tmp_path, 1.5)
    with pytest.raises(SystemExit) as exited:
        main(["report", str(BASE), str(ok), str(bad), "--fail-if", "ttft_p99_ms>1.1x"])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    expected = (
        f"cadence report: {bad.name}: ttft_p99_ms>1.1x failed: ttft_p99_ms "
        f"{load(bad).ttft_ms.p99:.4g} against a bound of "
        f"{1.1 * load(BASE).ttft_ms.p99:.4g}"
    )
    assert err == [expected]


def exit_code(capsys, *args: str) -> tuple[int, str]:
    """The command's exit status and what it wrote to stderr."""
    with pytest.raises(SystemExit) as exited:
        main(["report", *args])
    return exited.value.code, capsys.readouterr().err


def test_one_line_for_what_cannot_be_compared(tmp_path, capsys) -> None:
    code, err = exit_code(capsys, str(BASE), str(DATA / "sweep_result_v0.json"))
    assert code == 3 and "is not a bench result" in err
    code, err = exit_code(
        capsys, str(BASE), "--fail-if", "ttft_p99_ms>1.1x", "--out", str(tmp_path)
    )
    assert code == 2 and "two or more results" in err
    code, err = exit_code(capsys, str(BASE), str(BASE), "--fail-if", "ttft_p99_ms=1")
    assert code == 2 and "expected METRIC>FACTORx" in err


def test_a_misspelled_metric_is_a_usage_error_not_a_regression(capsys) -> None:
    for gate in ("ttft_p99_msx>1.1x", "lost>0", "tokens_per_sec<0.9x"):
        code, err = exit_code(capsys, str(BASE), str(BASE), "--fail-if", gate)
        assert code == 2 and "unknown metric" in err, (gate, err)


def with_integrity(tmp_path: Path, name: str, **counts: int) -> Path:
    data = json.loads(BASE.read_text())
    data["integrity"] = {**data["integrity"], **counts}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_gates_on_integrity(tmp_path, capsys) -> None:
    swapped = with_integrity(tmp_path, "swapped", reordered_chunks=1)
    assert metric(load(swapped), "reordered_chunks") == 1
    assert metric(load(swapped), "integrity_faults") == 1
    assert metric(load(swapped), "lost_tokens") == 0
    main(["report", str(BASE), str(BASE), "--fail-if", "integrity_faults>0"])
    code, err = exit_code(
        capsys,
        str(BASE),
        str(swapped),
        "--fail-if",
        "lost_tokens>0",
        "--fail-if",
        "reordered_chunks>0",
    )
    assert code == 1
    assert err.strip().splitlines() == [
        "cadence report: swapped.json: reordered_chunks>0 failed: reordered_chunks 1 against "
        "a bound of 0"
    ]


@pytest.mark.slow
def test_an_absolute_gate_judges_a_single_run(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    swapped = with_integrity(tmp_path, "swapped", reordered_chunks=1)
    main(["report", str(BASE), "--out", str(tmp_path / "base"), "--fail-if", "integrity_faults>0"])
    code, err = exit_code(
        capsys, str(swapped), "--out", str(tmp_path / "swapped"), "--fail-if", "integrity_faults>0"
    )
    assert code == 1 and "integrity_faults>0 failed" in err
    assert (tmp_path / "swapped" / "report.html").exists()  # written before the judging


def test_an_uncounted_check_is_missing_not_zero(tmp_path) -> None:
    data = json.loads(BASE.read_text())
    data["workload"]["protocol"] = "grpc"
    data["workload"]["grpc"] = {"method": "a.B/C", "types_from": "reflection"}
    path = tmp_path / "grpc.json"
    path.write_text(json.dumps(data))
    run = load(path)
    assert math.isnan(metric(run, "lost_tokens"))
    assert "missing" in parse_gate("lost_tokens>0").failure(run, run, "grpc")
