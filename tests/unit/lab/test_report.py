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
from cadence.lab.records import RequestRecord
from cadence.lab.report import plots
from cadence.lab.report.run import decode_result, render_report
from cadence.lab.report.summary import print_summary
from cadence.lab.results import BenchResult

_T0 = 5_000_000_000_000  # an arbitrary monotonic origin (ns)
_MS = 1_000_000


def _record(
    i: int,
    start_ms: float,
    ttft_ms: float,
    gaps_ms: list[float],
    tokens: list[int] | None = None,
    code: str = "OK",
) -> RequestRecord:
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
        request_id=f"r{i}",
        process=i % 2,
        start_ns=start,
        end_ns=arrival[-1] + _MS // 10,
        code=code,
        error="" if code == "OK" else "boom",
        prompt_tokens=16,
        max_tokens=pos,
        finish_reason=1,
        arrival_ns=arrival if code == "OK" else [],
        tokens=tokens if code == "OK" else [],
        index=index if code == "OK" else [],
        # admitted by the step that made the first token, so TTFT's parts add up to it
        t_received_ns=step_end[0] - 3 * _MS,
        t_scheduled_ns=step_end[0] - 2 * _MS,
        t_step_start_ns=[e - 2 * _MS for e in step_end] if code == "OK" else [],
        t_step_end_ns=step_end if code == "OK" else [],
        t_front_recv_ns=[e + _MS // 5 for e in step_end] if code == "OK" else [],
        t_send_ns=[e + _MS // 2 for e in step_end] if code == "OK" else [],
    )


def _records(shift_ms: float = 0.0) -> list[RequestRecord]:
    records = [
        _record(
            i,
            start_ms=i * 7.0,
            ttft_ms=10.0 + i + shift_ms,
            gaps_ms=[20.0 + (i % 3), 21.0, 40.0, 19.0 + shift_ms, 22.0],
            tokens=[1, 1, 1, 2, 1, 1],
        )
        for i in range(8)
    ]
    records.append(_record(8, start_ms=3.0, ttft_ms=0.0, gaps_ms=[], code="UNAVAILABLE"))
    return records


def _result(records: list[RequestRecord], with_records: bool = True) -> dict:
    result = msgspec.to_builtins(summarize(records))
    result["workload"] = {
        "target": "127.0.0.1:50051",
        "requests": len(records),
        "concurrency": 4,
        "max_tokens": [7],
        "prompt_tokens": [16],
    }
    result["client"] = {
        "processes": 2,
        "cpu_s": 0.4,
        "cpu_per_chunk_us": 120.0,
        "busiest_process_cpu_share": 0.35,
    }
    if with_records:
        result["records"] = msgspec.to_builtins(records)
    return result


def _full_result() -> dict:
    result = _result(_records())
    result["system"] = {
        "interval_s": 0.1,
        "processes": {
            "front": {
                "pid": 11,
                "cpu_pct_mean": 55.0,
                "cpu_pct_max": 97.0,
                "samples": [[0.1 * k, 40.0 + 5 * (k % 4)] for k in range(20)],
            },
            "worker0": {
                "pid": 12,
                "cpu_pct_mean": 20.0,
                "cpu_pct_max": 30.0,
                "samples": [[0.1 * k, 20.0] for k in range(20)],
            },
        },
        "gpus": [
            {
                "index": 0,
                "util_pct_mean": 12.0,
                "util_pct_max": 20.0,
                "mem_used_mb_max": 900.0,
                "samples": [[0.1 * k, 10.0, 900.0] for k in range(20)],
            }
        ],
        "flags": ["CPU busy while the cards idle: front"],
    }
    result["diagnosis"] = [
        {
            "rule": "front_cpu_bound",
            "finding": "The front is CPU-bound",
            "evidence": {"front_cpu": "97% of a core"},
            "look_at": "--procs, uvloop",
        },
        {
            "rule": "ttft_engine_start",
            "finding": "the first step is slow",
            "evidence": {"first_step_mean_ms": 812.5, "ttft_share_first_step": 0.93},
            "look_at": "--warmup",
        },
    ]
    result["baseline"] = {k: result[k] for k in ("ttft_ms", "itl_ms", "tokens_per_s")}
    result["overhead_ms"] = {
        "ttft_ms": {"mean": 1.25, "p50": 1.5, "p90": 2.0, "p99": 3.5, "max": 4.0}
    }
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
    decoded, why_not = decode_result({"records": msgspec.to_builtins(records)})
    assert decoded.records == records and why_not == ""


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
    _assert_pngs(
        out, {"ttft_cdf.png", "itl_cdf.png", "itl_over_time.png", "segments.png", "cpu.png"}
    )
    assert page.count("data:image/png;base64,") == 5
    for name in (
        "ttft_ms",
        "itl_ms",
        "chunk_gap_ms",
        "tpot_ms",
        "e2e_ms",
        "token_delay_ms",
        "chunk_tokens",
        "client_to_front",
        "queue",
        "engine_step",
        "transfer",
        "buffer",
        "send",
        "first_step",
        "lost_tokens",
        "short_streams",
        "UNAVAILABLE",
        "tokens/s",
    ):
        assert name in page, name
    for text in (
        "front_cpu_bound",
        "The front is CPU-bound",
        "front_cpu <b>97% of a core</b>",
        "--procs, uvloop",
        "CPU busy while the cards idle",
        "worker0",
        "127.0.0.1:50051",
        "engine-only baseline",
        "<h2>Client</h2>",
        "first_step_mean_ms <b>812.50</b>",
        "ttft_share_first_step <b>0.930</b>",
        "Serving overhead",
        "+3.50",
    ):
        assert text in page, text
    assert "No rule fired" not in page


def test_report_with_little_in_it(tmp_path: Path):
    """No records, system or segments; an empty diagnosis; NaN aggregates."""
    result = _result(_records(), with_records=False)
    for key in ("segments_ms", "ttft_segments_ms", "segment_shares", "token_delay_ms"):
        result.pop(key)
    result["tpot_ms"] = dict.fromkeys(result["tpot_ms"], math.nan) | {"count": 0}
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
        {
            "value": str(value),
            "repeats": [
                _result(_records(shift_ms=value + r), with_records=False) for r in range(2)
            ],
        }
        for value in (16, 1, 4)
    ]
    points[0]["repeats"][1]["diagnosis"] = [
        {
            "rule": "queueing",
            "finding": "requests wait",
            "evidence": {"queue_p99_ms": 9.0},
            "look_at": "--max-batch",
        }
    ]
    points[0]["repeats"][0]["system"] = {"processes": {"front": {"cpu_pct_mean": 61.0}}}
    sweep = {
        "variable": "concurrency",
        "serve_args": ["--devices", "cpu:2"],
        "repeat": 2,
        "points": points,
    }
    path = render_report({"sweep": sweep}, tmp_path)
    page = path.read_text()
    _assert_self_contained(page)
    _assert_pngs(tmp_path, {"sweep.png"})
    assert "<h1>cadence sweep over concurrency</h1>" in page
    assert "Workload (of the sweep&#x27;s first run)" in page and "127.0.0.1:50051" in page
    assert (
        page.index("concurrency = 1 ")
        < page.index("concurrency = 4 ")
        < page.index("concurrency = 16 ")
    )
    for name in (
        "ttft_ms p50",
        "ttft_ms p99",
        "itl_ms mean",
        "itl_ms p90",
        "tokens_per_s",
        "requests wait",
        "--devices cpu:2",
        "CPU % front",
        "61.00",
    ):
        assert name in page, name
    mean, low, high = plots.spread(points[1]["repeats"], "ttft_ms", "p50")
    assert low < mean < high

    categorical = {
        "sweep": {
            "variable": "transport",
            "points": [
                {"value": "ipc", "repeats": [_result(_records(), with_records=False)]},
                {"value": "tcp", "repeats": []},
            ],
        }
    }
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
    _assert_pngs(
        expected.parent, {"ttft_cdf.png", "itl_cdf.png", "itl_over_time.png", "segments.png"}
    )

    small = tmp_path / "small.json"
    small.write_text(json.dumps({"ttft_ms": result["ttft_ms"], "workload": result["workload"]}))
    main(["report", str(small), "--out", str(tmp_path / "elsewhere")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "elsewhere" / "report.html")

    with pytest.raises(SystemExit) as exited:
        main(["report", str(tmp_path / "missing.json")])
    assert exited.value.code == 3 and "cannot read" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit) as exited:
        main(["report", str(tmp_path / "bad.json")])
    assert exited.value.code == 3 and "not JSON" in capsys.readouterr().err


def _assert_no_orphans(page: str) -> None:
    """No table without rows, no heading over nothing (next to a heading as high or the end)."""
    assert "<tbody></tbody>" not in page
    for m in re.finditer(r"<h([1-6])>[^<]*</h\1>\s*(<h([1-6])>|</body>)", page):
        assert m.group(3) and int(m.group(3)) > int(m.group(1)), m.group(0)


def test_segments_plot_keeps_a_request_and_a_chunk_apart(tmp_path: Path):
    result = _result(_records())
    stacks = plots.segment_stacks(decode_result(result)[0])
    ttft, token = stacks
    assert [n for n, _ in ttft.parts] == [
        "client_to_front",
        "queue",
        "first_step",
        "transfer",
        "buffer",
        "send",
    ]
    assert [n for n, _ in token.parts] == ["engine_step", "transfer", "buffer", "send"]
    # each bar's total is the mean of the whole it claims
    assert ttft.total == pytest.approx(result["ttft_ms"]["mean"])
    path_mean = result["segments_ms"]["engine_step"]["mean"] + result["token_delay_ms"]["mean"]
    assert token.total == pytest.approx(path_mean)
    assert plots.plot_segments(stacks, tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")
    page = render_report(result, tmp_path / "rep").read_text()
    assert "<h3>Time to first token, per request</h3>" in page
    assert "<h3>A token&#x27;s path, per chunk</h3>" in page
    older = {k: v for k, v in result.items() if k != "ttft_segments_ms"}
    assert [s.title for s in plots.segment_stacks(decode_result(older)[0])] == [token.title]


def _grpc_result(index_field: str | None) -> dict:
    result = _result(_records(), with_records=False)
    result["workload"] |= {
        "protocol": "grpc",
        "grpc": {
            "method": "/demo.Gen/Stream",
            "types_from": "reflection v1alpha",
            "bidirectional": False,
            "request_json": '{"prompt": "{prompt}"}',
            "tokens_field": "text",
            "index_field": index_field,
            "headers": [],
        },
    }
    result["integrity"]["short_streams"] = 0
    return result


def test_grpc_workload_and_its_integrity(tmp_path: Path, capsys, monkeypatch):
    page = render_report(_grpc_result(None), tmp_path / "plain").read_text()
    assert "<td>grpc.method</td><td>/demo.Gen/Stream</td>" in page
    assert "<td>grpc.tokens_field</td><td>text</td>" in page
    assert "<td>grpc.index_field</td><td>not given: positions unknown" in page
    assert "<code>{&quot;prompt&quot;: &quot;{prompt}&quot;}</code>" in page
    assert "Integrity not checked" in page
    assert "short_streams" not in page and "lost_tokens" not in page
    _assert_no_orphans(page)

    page = render_report(_grpc_result("pos"), tmp_path / "indexed").read_text()
    assert "<td>lost_tokens</td>" in page and "<td>short_streams</td>" not in page
    assert "short_streams not counted" in page
    assert (
        "<td>short_streams</td>" in render_report(_result(_records()), tmp_path / "v1").read_text()
    )


def test_no_orphan_tables(tmp_path: Path):
    result = _full_result()
    result["system"]["server_metrics"] = {
        "url": "http://127.0.0.1:9/metrics",
        "scrapes": 0,
        "peaks": {},
        "during_run": {},
        "samples": [],
    }
    result["system"]["gpus"] = []
    result["workers"] = []
    page = render_report(result, tmp_path / "full").read_text()
    assert "Server metrics" not in page and "<h2>Workers</h2>" not in page
    _assert_no_orphans(page)
    _assert_no_orphans(render_report({}, tmp_path / "empty").read_text())
    _assert_no_orphans(
        render_report(
            {"sweep": {"variable": "rate", "points": []}}, tmp_path / "nothing"
        ).read_text()
    )


def test_run_metadata_table(tmp_path: Path):
    result = _full_result()
    result["run"] = {
        "started_at": "2026-12-04T11:00:00+00:00",
        "cadence_version": "0.9.0",
        "grpcio_version": "1.68.1",
        "python_version": "3.12.3",
        "host": "lab-1",
        "cpu_count": 16,
        "server_cmdline": ["cadence", "serve", "--port", "0"],
    }
    page = render_report(result, tmp_path / "run").read_text()
    assert "<h2>Run</h2>" in page
    for cell in (
        "2026-12-04T11:00:00+00:00",
        "0.9.0",
        "1.68.1",
        "3.12.3",
        "lab-1",
        "<td>16</td>",
        "<code>cadence serve --port 0</code>",
    ):
        assert cell in page, cell
    result["run"]["server_cmdline"] = None
    assert "not known" in render_report(result, tmp_path / "found").read_text()
    assert "<h2>Run</h2>" not in render_report(_full_result(), tmp_path / "older").read_text()


def test_negative_overhead_reads_as_noise(tmp_path: Path, capsys):
    result = _full_result()
    result["overhead_ms"]["itl_ms"] = {
        "mean": -0.07,
        "p50": 0.2,
        "p90": -0.59,
        "p99": -0.67,
        "max": -0.26,
    }
    page = render_report(result, tmp_path).read_text()
    assert "-0.67" not in page and "−0.67" not in page
    assert "<td>itl_ms</td><td>within noise</td><td>+0.20</td><td>within noise</td>" in page
    print_summary(_summary_ready(result))
    out = capsys.readouterr().out
    assert "itl_ms p50 +0.20 p99 within noise" in out and "-0.67" not in out


def _summary_ready(result: dict) -> BenchResult:
    """The result as `cadence bench` hands it to the summary (typed, no findings)."""
    result = dict(result, diagnosis=[])
    result["client"] = result["client"] | {"schedule_slips": 0}
    return decode_result(result)[0]


def test_piped_summary_is_not_wrapped(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    result = _full_result()
    result["workers"] = [
        {
            "worker": 0,
            "device": "cuda:0 (a card with a long descriptive name)",
            "step_ms_p50": 12.25,
            "step_ms_p90": 19.5,
            "sequences_per_step_p50": 64,
            "tokens_per_s": 123456.0,
            "token_share": 0.5,
            "itl_ms_p50": 15.75,
        }
    ]
    print_summary(_summary_ready(result))
    lines = capsys.readouterr().out.splitlines()
    worker = [line for line in lines if line.startswith("worker 0")]
    assert len(worker) == 1 and worker[0].endswith("its streams' ITL p50 15.8 ms")
    requests = [line for line in lines if line.startswith("requests ")]
    assert len(requests) == 1 and "requests/s" in requests[0]


def test_summary_names_only_the_counted_checks(capsys):
    for index_field, shown in (
        (None, "integrity: not checked"),
        ("pos", "integrity: lost 0, repeated 0, reordered 0\n"),
    ):
        result = _grpc_result(index_field)
        result["workload"]["model"] = None
        print_summary(_summary_ready(result))
        out = capsys.readouterr().out
        assert shown in out and "short streams" not in out
    print_summary(_summary_ready(_full_result()))
    assert "short streams 0" in capsys.readouterr().out


def test_sweep_report_is_titled_by_the_sweep_and_names_its_rules(tmp_path: Path):
    points = [
        {
            "value": f"{c},{m}",
            "values": {"concurrency": str(c), "max_tokens": str(m)},
            "repeats": [_result(_records(shift_ms=c * m), with_records=False)],
        }
        for c in (4, 1)
        for m in (64, 8)
    ]
    points[0]["repeats"][0]["diagnosis"] = [
        {
            "rule": "queueing",
            "finding": "requests wait",
            "evidence": {"queue_p99_ms": 9.0},
            "look_at": "-",
        }
    ]
    points[1]["repeats"][0]["diagnosis"] = []
    points[3] |= {"repeats": [], "failures": ["the server exited with status 1"]}
    sweep = {"variable": "concurrency,max_tokens", "repeat": 1, "points": points}
    page = render_report({"sweep": sweep}, tmp_path, source="grid.json").read_text()
    assert "<h1>cadence sweep over concurrency × max_tokens</h1>" in page
    assert "127.0.0.1:50051" not in page.split("</h1>")[0]
    assert "from grid.json" in page
    assert "<th>concurrency</th><th>max_tokens</th>" in page
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td>.*?</tr>", page)
    assert rows == [("1", "8"), ("1", "64"), ("4", "8"), ("4", "64")]
    assert re.search(r"<td>4</td><td>64</td>.*?<td>queueing</td></tr>", page)
    assert re.search(r"<td>4</td><td>8</td>.*?<td>none</td></tr>", page)
    assert re.search(r"<td>1</td><td>8</td>.*?<td>—</td></tr>", page)
    assert "concurrency = 4, max_tokens = 64 (1 repeats)" in page
    assert '<td>concurrency = 1, max_tokens = 8</td><td class="bad">the server exited' in page
    _assert_no_orphans(page)


def test_sweep_axes_go_log_over_decades():
    def sweep_of(shift: float) -> dict:
        return {
            "variable": "concurrency",
            "points": [
                {
                    "value": str(c),
                    "repeats": [_result(_records(shift_ms=shift * c), with_records=False)],
                }
                for c in (1, 4, 64)
            ],
        }

    def figure(shift: float):
        return plots.sweep_figure(decode_result({"sweep": sweep_of(shift)})[0].sweep)

    ttft = figure(50.0).axes[0]
    assert ttft.get_yscale() == "log" and ttft.get_xscale() == "log"
    assert figure(0.0).axes[0].get_yscale() == "linear"
    assert plots.spans_decades([1.0, 10.0]) and not plots.spans_decades([1.0, 9.0])
    assert not plots.spans_decades([0.0, 100.0])


DATA = Path(__file__).parents[2] / "data"


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*_result*.json")))
def test_report_of_results_written_by_the_lab(name: str, tmp_path: Path, capsys):
    """Every kind of result the lab wrote before the report read typed results."""
    main(["report", str(DATA / name), "--out", str(tmp_path)])
    page = (tmp_path / "report.html").read_text()
    assert capsys.readouterr().out.strip() == str(tmp_path / "report.html")
    # the metrics and OpenAI URLs are shown as text; nothing is loaded from anywhere
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert "<script" not in page.lower() and "<link" not in page.lower()
    _assert_no_orphans(page)
    assert f"from {name}" in page
    if "grpc" in name:
        assert "short_streams" not in page and "Integrity not checked" in page
    if "baseline" in name:
        assert "<td>itl_ms</td><td>within noise</td>" in page
    if name.startswith("sweep"):
        assert "<h1>cadence sweep over concurrency</h1>" in page


def test_cli_report_of_something_else(tmp_path: Path, capsys):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"workload": "127.0.0.1:1"}))
    with pytest.raises(SystemExit) as exited:
        main(["report", str(wrong)])
    assert exited.value.code == 3
    assert re.search(
        r"wrong.json is not a bench or sweep result: .*workload", capsys.readouterr().err
    )


def test_the_strongest_dependence_is_drawn_from_what_the_result_keeps(tmp_path: Path):
    """The report draws each latency's curve as the analysis stored it (no records needed):
    a numeric variable as a line with its quartile band, a period as bars by position."""
    result = _result(_records(), with_records=False)
    result["dependence"] = [
        {
            "latency": "ttft",
            "variable": "prompt_tokens",
            "shape": "faster_than_linear",
            "size": "TTFT grows as the square of prompt_tokens: 33.4 ms at 123, 349.3 ms at 635",
            "named": True,
            "strength": 0.93,
            "tail_share": 0.91,
            "x": [100.0, 300.0, 500.0, 700.0],
            "median_ms": [20.0, 80.0, 210.0, 390.0],
            "p25_ms": [15.0, 70.0, 190.0, 350.0],
            "p75_ms": [25.0, 95.0, 230.0, 420.0],
            "n": [12, 12, 12, 12],
        },
        {
            "latency": "gap",
            "variable": "position",
            "shape": "periodic",
            "size": "gaps at positions 16, 32 ... (every 16) are 5.1x the others",
            "named": True,
            "tail_share": 0.96,
            "period": 4,
            "x": [0.0, 1.0, 2.0, 3.0],
            "median_ms": [43.5, 8.6, 8.5, 8.7],
            "p25_ms": [41.0, 8.1, 8.0, 8.2],
            "p75_ms": [46.0, 9.1, 9.0, 9.2],
            "n": [30, 30, 30, 30],
        },
    ]
    out = tmp_path / "rep"
    page = render_report(result, out).read_text()
    assert (out / "dependence.png").read_bytes().startswith(b"\x89PNG")
    assert "What the latency depends on" in page
    assert "TTFT grows as the square of prompt_tokens" in page and "91%" in page
    assert page.count("dependence.png") == 0  # embedded, not linked
    empty = render_report(_result(_records(), with_records=False), tmp_path / "none").read_text()
    assert "What the latency depends on" not in empty
