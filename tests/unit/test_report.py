"""`cadence report`: plots and one self-contained HTML page from a bench or sweep result."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import msgspec
import pytest

from cadence.cli import main
from cadence.lab.analysis.stats import distribution, itl_points, summarize
from cadence.lab.load.records import RequestRecord
from cadence.lab.report import plots
from cadence.lab.report.run import render_report

_T0 = 5_000_000_000_000  # an arbitrary monotonic origin (ns)
_MS = 1_000_000


def _record(i: int, start_ms: float, ttft_ms: float, gaps_ms: list[float],
            tokens: list[int] | None = None, code: str = "OK") -> RequestRecord:
    """A request with the given TTFT and chunk gaps, and consistent server timestamps."""
    start = _T0 + int(start_ms * _MS)
    arrival = [start + int(ttft_ms * _MS)]
    for gap in gaps_ms:
        arrival.append(arrival[-1] + int(gap * _MS))
    tokens = tokens or [1] * len(arrival)
    index, pos = [], 0
    for k in tokens:
        index.append(pos)
        pos += k
    step_end = [a - int(0.8 * _MS) for a in arrival]
    return RequestRecord(
        request_id=f"r{i}", process=i % 2, start_ns=start, end_ns=arrival[-1] + _MS // 10,
        code=code, error="" if code == "OK" else "boom", prompt_tokens=16, max_tokens=pos,
        finish_reason=1, arrival_ns=arrival if code == "OK" else [], tokens=tokens if code == "OK" else [],
        index=index if code == "OK" else [],
        t_received_ns=start + _MS // 2, t_scheduled_ns=start + _MS,
        t_step_start_ns=[e - 2 * _MS for e in step_end] if code == "OK" else [],
        t_step_end_ns=step_end if code == "OK" else [],
        t_front_recv_ns=[e + _MS // 5 for e in step_end] if code == "OK" else [],
        t_send_ns=[e + _MS // 2 for e in step_end] if code == "OK" else [],
    )


def _records(shift_ms: float = 0.0) -> list[RequestRecord]:
    records = [
        _record(i, start_ms=i * 7.0, ttft_ms=10.0 + i + shift_ms,
                gaps_ms=[20.0 + (i % 3), 21.0, 40.0, 19.0 + shift_ms, 22.0],
                tokens=[1, 1, 1, 2, 1, 1])
        for i in range(8)
    ]
    records.append(_record(8, start_ms=3.0, ttft_ms=0.0, gaps_ms=[], code="UNAVAILABLE"))
    return records


def _result(records: list[RequestRecord], with_records: bool = True) -> dict:
    result = msgspec.to_builtins(summarize(records))
    result["workload"] = {"target": "127.0.0.1:50051", "requests": len(records), "concurrency": 4,
                          "max_tokens": [7], "prompt_tokens": [16]}
    result["client"] = {"processes": 2, "cpu_s": 0.4, "cpu_per_chunk_us": 120.0,
                        "busiest_process_cpu_share": 0.35}
    if with_records:
        result["records"] = msgspec.to_builtins(records)
    return result


def _full_result() -> dict:
    result = _result(_records())
    result["system"] = {
        "interval_s": 0.1,
        "processes": {
            "front": {"pid": 11, "cpu_pct_mean": 55.0, "cpu_pct_max": 97.0,
                      "samples": [[0.1 * k, 40.0 + 5 * (k % 4)] for k in range(20)]},
            "worker0": {"pid": 12, "cpu_pct_mean": 20.0, "cpu_pct_max": 30.0,
                        "samples": [[0.1 * k, 20.0] for k in range(20)]},
        },
        "gpus": [{"index": 0, "util_pct_mean": 12.0, "util_pct_max": 20.0, "mem_used_mb_max": 900.0,
                  "samples": [[0.1 * k, 10.0, 900.0] for k in range(20)]}],
        "flags": ["CPU busy while the cards idle: front"],
    }
    result["diagnosis"] = [
        {"rule": "front_cpu_bound", "finding": "The front is CPU-bound",
         "evidence": "front at 97% of a core", "look_at": "--procs, uvloop"},
        {"rule": "ttft_engine_start", "finding": "the first step is slow",
         "evidence": {"first_step_mean_ms": 812.5, "ttft_share_first_step": 0.93},
         "look_at": "--warmup"},
    ]
    result["baseline"] = {k: result[k] for k in ("ttft_ms", "itl_ms", "tokens_per_s")}
    result["overhead_ms"] = {"ttft_ms": {"mean": 1.25, "p50": 1.5, "p90": 2.0, "p99": 3.5,
                                         "max": 4.0}}
    return result


def _assert_self_contained(page: str) -> None:
    assert "data:image/png;base64," in page
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page.lower() and "<link" not in page.lower()


def _assert_pngs(out_dir: Path, names: set[str]) -> None:
    written = {p.name for p in out_dir.glob("*.png")}
    assert written == names
    for name in names:
        assert (out_dir / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_plot_values_use_the_summary_definitions():
    records = _records()
    result = msgspec.to_builtins(summarize(records))
    ttft, itl = plots.ttft_values(records), plots.itl_values(records)
    assert msgspec.to_builtins(distribution(ttft)) == result["ttft_ms"]
    assert msgspec.to_builtins(distribution(itl)) == result["itl_ms"]
    assert ttft[0] == pytest.approx(10.0)
    # the 2-token chunk after the 40 ms gap counts 20 ms per token; errors count nothing
    assert 40.0 not in [round(v, 6) for v in itl] and min(itl) == pytest.approx(19.0)
    first = [round(v, 6) for _, v in itl_points(records[0])]
    assert first == [20.0, 21.0, 20.0, 19.0, 22.0]
    assert len(itl) == 8 * 5
    decoded = plots.decode_records(msgspec.to_builtins(records))
    assert decoded == records


def test_pick_streams_keeps_the_worst():
    records = _records()
    records[5] = _record(5, 35.0, 15.0, [20.0, 300.0, 20.0])
    picked = plots.pick_streams(records, 5)
    assert len(picked) == 5 and records[5] in picked
    assert all(r.code == "OK" for r in picked)


def test_report_of_one_run(tmp_path: Path):
    out = tmp_path / "rep"
    path = render_report(_full_result(), out)
    assert path == out / "report.html" and path.exists()
    page = path.read_text()
    _assert_self_contained(page)
    _assert_pngs(out, {"ttft_cdf.png", "itl_cdf.png", "itl_over_time.png", "segments.png", "cpu.png"})
    assert page.count("data:image/png;base64,") == 5
    for name in ("ttft_ms", "itl_ms", "chunk_gap_ms", "tpot_ms", "e2e_ms", "token_delay_ms",
                 "chunk_tokens", "client_to_front", "queue", "engine_step", "transfer", "buffer",
                 "send", "first_step", "lost_tokens", "short_streams", "UNAVAILABLE", "tokens/s"):
        assert name in page, name
    for text in ("front_cpu_bound", "The front is CPU-bound", "front at 97% of a core",
                 "--procs, uvloop", "CPU busy while the cards idle", "worker0", "127.0.0.1:50051",
                 "engine-only baseline", "Client CPU", "first_step_mean_ms <b>812.50</b>",
                 "ttft_share_first_step <b>0.930</b>", "Serving overhead", "+3.50"):
        assert text in page, text
    assert "No rule fired" not in page


def test_report_with_little_in_it(tmp_path: Path):
    """No records, system or segments; an empty diagnosis; NaN aggregates."""
    result = _result(_records(), with_records=False)
    for key in ("segments_ms", "ttft_segments_ms", "segment_shares", "token_delay_ms"):
        result.pop(key)
    result["tpot_ms"] = {k: math.nan for k in result["tpot_ms"]} | {"count": 0}
    result["diagnosis"] = []
    result["baseline"] = {"error": "the engine-only baseline needs a cadence server on this host"}
    path = render_report(result, tmp_path)
    page = path.read_text()
    assert "No rule fired" in page
    assert "No baseline: the engine-only baseline needs" in page
    assert "No raw records" in page
    assert "<h2>System</h2>" not in page
    _assert_pngs(tmp_path, set())
    assert "data:image/png" not in page

    assert render_report({}, tmp_path / "empty").exists()
    broken = render_report({"records": [["r0", "not a process id"]]}, tmp_path / "broken")
    assert "Records could not be read" in broken.read_text()


def test_report_of_a_sweep(tmp_path: Path):
    # as `cadence sweep` writes it: values as typed (strings), repeats without records
    points = [
        {"value": str(value), "repeats": [_result(_records(shift_ms=value + r), with_records=False)
                                          for r in range(2)]}
        for value in (16, 1, 4)
    ]
    points[0]["repeats"][1]["diagnosis"] = [{"rule": "queueing", "finding": "requests wait",
                                             "evidence": "queue p99 9 ms", "look_at": "--max-batch"}]
    points[0]["repeats"][0]["system"] = {"processes": {"front": {"cpu_pct_mean": 61.0}}}
    sweep = {"variable": "concurrency", "serve_args": ["--devices", "cpu:2"], "repeat": 2,
             "points": points}
    path = render_report({"sweep": sweep}, tmp_path)
    page = path.read_text()
    _assert_self_contained(page)
    _assert_pngs(tmp_path, {"sweep.png"})
    assert "Sweep over concurrency" in page
    assert "Workload (of the sweep&#x27;s first run)" in page and "127.0.0.1:50051" in page
    assert page.index("concurrency = 1 ") < page.index("concurrency = 4 ") < page.index(
        "concurrency = 16 ")
    for name in ("ttft_ms p50", "ttft_ms p99", "itl_ms mean", "itl_ms p90", "tokens_per_s",
                 "requests wait", "--devices cpu:2", "CPU % front", "61.00"):
        assert name in page, name
    mean, low, high = plots.spread(points[1]["repeats"], "ttft_ms", "p50")
    assert low < mean < high

    categorical = {"sweep": {"variable": "transport", "points": [
        {"value": "ipc", "repeats": [_result(_records(), with_records=False)]},
        {"value": "tcp", "repeats": []},
    ]}}
    out = tmp_path / "categorical"
    page = render_report(categorical, out).read_text()
    _assert_pngs(out, {"sweep.png"})
    assert "transport = tcp" in page


def test_cli_report(tmp_path: Path, capsys):
    source = tmp_path / "run.json"
    result = _result(_records())
    result["diagnosis"] = []
    source.write_text(json.dumps(result))  # NaN aggregates go through JSON as NaN
    main(["report", str(source)])
    expected = tmp_path / "run-report" / "report.html"
    assert capsys.readouterr().out.strip() == str(expected)
    page = expected.read_text()
    _assert_self_contained(page)
    assert "No rule fired" in page and "run.json" in page
    _assert_pngs(expected.parent, {"ttft_cdf.png", "itl_cdf.png", "itl_over_time.png", "segments.png"})

    small = tmp_path / "small.json"
    small.write_text(json.dumps({"ttft_ms": result["ttft_ms"], "workload": result["workload"]}))
    main(["report", str(small), "--out", str(tmp_path / "elsewhere")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "elsewhere" / "report.html")

    with pytest.raises(SystemExit, match="cannot read"):
        main(["report", str(tmp_path / "missing.json")])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match="not JSON"):
        main(["report", str(tmp_path / "bad.json")])
