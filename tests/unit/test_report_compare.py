"""`cadence report a.json b.json`: runs side by side with ratios, and --fail-if gates."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from cadence.cli import main
from cadence.lab.report.compare import metric, parse_gate, rows
from cadence.lab.results import BenchResult

DATA = Path(__file__).resolve().parents[1] / "data"
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
    worse = msgspec.structs.replace(base, ttft_ms=msgspec.structs.replace(
        base.ttft_ms, p99=base.ttft_ms.p99 * 1.2))
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
    expected = (f"cadence report: {bad.name}: ttft_p99_ms>1.1x failed: ttft_p99_ms "
                f"{load(bad).ttft_ms.p99:.4g} against a bound of "
                f"{1.1 * load(BASE).ttft_ms.p99:.4g}")
    assert err == [expected]


def test_one_line_for_what_cannot_be_compared(tmp_path) -> None:
    with pytest.raises(SystemExit, match="is not a bench result"):
        main(["report", str(BASE), str(DATA / "sweep_result_v0.json")])
    with pytest.raises(SystemExit, match="two or more results"):
        main(["report", str(BASE), "--fail-if", "errors>0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="expected METRIC>FACTORx"):
        main(["report", str(BASE), str(BASE), "--fail-if", "ttft_p99_ms=1"])
