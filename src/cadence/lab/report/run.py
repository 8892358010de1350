"""One self-contained HTML report of a `cadence bench` result or of a sweep.

`render_report` writes the plots as PNGs into the output folder and one `report.html` that
embeds them as base64 data URIs, with inline CSS and no external resource. Every optional
part of a result (records, segments, system, diagnosis, baseline, sweep) may be missing.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from cadence.lab.measure.scrape import worker_startup
from cadence.lab.report import plots

AGGREGATES = (
    "ttft_ms", "itl_ms", "chunk_gap_ms", "tpot_ms", "e2e_ms", "token_delay_ms", "chunk_tokens",
)
"""Aggregates in the order they are shown; any other distribution-shaped key follows."""
STATS = ("mean", "p50", "p90", "p99", "max")
THROUGHPUT = (
    ("requests", "requests"), ("requests_ok", "requests OK"), ("wall_s", "wall (s)"),
    ("output_tokens", "output tokens"), ("chunks", "chunks"), ("requests_per_s", "requests/s"),
    ("tokens_per_s", "tokens/s"), ("chunks_per_s", "chunks/s"),
)
INTEGRITY = ("lost_tokens", "repeated_tokens", "reordered_chunks", "short_streams")
REPORT_NAME = "report.html"

_CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1d232b;
       max-width: 1180px; margin: 1.5em auto; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em;
     border-bottom: 1px solid #d6dbe1; padding-bottom: 0.2em; } h3 { font-size: 1.05em; }
.sub { color: #5b6672; margin-top: 0; }
table { border-collapse: collapse; margin: 0.6em 0; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d6dbe1; padding: 3px 9px; text-align: right; }
th { background: #f1f4f7; } td:first-child, th:first-child { text-align: left; }
td.bad { background: #fde2e1; color: #8a1f17; font-weight: 600; }
.note { color: #5b6672; font-size: 0.92em; }
.finding { border-left: 4px solid #d9822b; background: #fff6ec; padding: 0.5em 0.8em;
           margin: 0.6em 0; } .finding .rule { font-weight: 600; }
.finding dl { margin: 0.3em 0 0; display: grid; grid-template-columns: max-content 1fr;
              gap: 0.15em 0.8em; } .finding dt { color: #5b6672; } .finding dd { margin: 0; }
.ok { color: #2f6f3e; font-weight: 600; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #e3e7ec; }
figcaption { color: #5b6672; font-size: 0.92em; }
details { margin: 0.5em 0; } summary { cursor: pointer; font-weight: 600; }
pre { background: #f6f8fa; padding: 0.6em; overflow-x: auto; font-size: 0.88em; }
"""


# -- formatting -----------------------------------------------------------------------------


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt(value: Any) -> str:
    """A number for a table cell: NaN and missing as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "—"
        if value == 0:
            return "0"
        if abs(value) < 1:
            return f"{value:.3f}"
        if abs(value) < 10_000:
            return f"{value:.2f}"
        return f"{value:,.0f}"
    if isinstance(value, (list, dict)):
        return _esc(json.dumps(value)[:200])
    return _esc(value)


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]],
           bad: Callable[[int, Any], bool] | None = None) -> str:
    """An HTML table; cells are formatted with `fmt` unless already markup (a `_Raw`).
    `bad(column, cell)` marks the cells to highlight."""
    out = ["<table><thead><tr>", *(f"<th>{_esc(h)}</th>" for h in header), "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>")
        for i, cell in enumerate(row):
            text = cell.html if isinstance(cell, _Raw) else fmt(cell)
            cls = ' class="bad"' if bad and bad(i, cell) else ""
            out.append(f"<td{cls}>{text}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


class _Raw:
    """Markup to put in a table cell as it is."""

    def __init__(self, markup: str) -> None:
        self.html = markup


def _is_distribution(value: Any) -> bool:
    return isinstance(value, dict) and {"count", "mean", "p50", "p99"} <= value.keys()


def aggregate_names(result: dict) -> list[str]:
    """The distribution-shaped top-level keys of a result, known ones first."""
    names = [n for n in AGGREGATES if _is_distribution(result.get(n))]
    return names + sorted(k for k, v in result.items() if k not in names and _is_distribution(v))


# -- sections of one run ---------------------------------------------------------------------


def _kv_table(mapping: dict) -> str:
    return _table(("key", "value"), ((k, v) for k, v in mapping.items()))


def _workload(result: dict) -> str:
    workload, title = result.get("workload"), "Workload"
    if not isinstance(workload, dict) or not workload:
        workload, title = _first_repeat(result).get("workload"), "Workload (of the sweep's first run)"
    if not isinstance(workload, dict) or not workload:
        return ""
    return f"<h2>{_esc(title)}</h2>" + _kv_table(workload)


def _first_repeat(result: dict) -> dict:
    sweep = result.get("sweep")
    for point in (sweep.get("points") or []) if isinstance(sweep, dict) else []:
        for repeat in (point.get("repeats") or []) if isinstance(point, dict) else []:
            if isinstance(repeat, dict):
                return repeat
    return {}


def _throughput(result: dict) -> str:
    rows = [(label, result[key]) for key, label in THROUGHPUT if key in result]
    if not rows:
        return ""
    return "<h2>Requests and throughput</h2>" + _table(("", "value"), rows)


def _aggregates(result: dict, title: str = "Latency and chunk aggregates") -> str:
    names = aggregate_names(result)
    if not names:
        return ""
    rows = [(n, result[n].get("count"), *(result[n].get(s) for s in STATS)) for n in names]
    return (f"<h2>{_esc(title)}</h2>" + _table(("metric", "count", *STATS), rows)
            + '<p class="note">ms unless the name says otherwise; chunk_tokens is tokens per '
              "chunk. Definitions: <code>cadence.lab.stats</code>.</p>")


def _segments(result: dict) -> str:
    parts = []
    segments = result.get("segments_ms")
    if isinstance(segments, dict) and segments:
        order = [n for n in plots.SEGMENT_ORDER if n in segments]
        order += [n for n in segments if n not in order]
        rows = [(n, (segments[n] or {}).get("count"), (segments[n] or {}).get("mean"),
                 (segments[n] or {}).get("p50"), (segments[n] or {}).get("p99")) for n in order]
        parts.append(
            "<h2>Where the time goes: segments</h2>"
            + _table(("segment (ms)", "count", "mean", "p50", "p99"), rows)
            + '<p class="note">client_to_front and queue: one value per request; engine_step, '
              "transfer, buffer, send: one per chunk, timed from its first token's engine "
              "step.</p>"
        )
    first = result.get("ttft_segments_ms")
    if isinstance(first, dict) and first:
        rows = [(n, (d or {}).get("mean"), (d or {}).get("p50"), (d or {}).get("p99"))
                for n, d in first.items()]
        parts.append("<h3>TTFT split (first chunk)</h3>"
                     + _table(("segment (ms)", "mean", "p50", "p99"), rows)
                     + '<p class="note">Per request these add up to its TTFT exactly.</p>')
    shares = result.get("segment_shares")
    if isinstance(shares, dict) and shares:
        names: list[str] = []
        for d in shares.values():
            names += [n for n in (d or {}) if n not in names]
        rows = [(n, *(_share(shares[k], n) for k in shares)) for n in names]
        parts.append("<h3>Segment shares of the mean</h3>"
                     + _table(("segment", *shares.keys()), rows))
    return "".join(parts)


def _share(d: dict | None, name: str) -> _Raw:
    v = (d or {}).get(name)
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return _Raw("—")
    return _Raw(f"{v:.1%}")


def _integrity(result: dict) -> str:
    integrity = result.get("integrity")
    errors = result.get("errors_by_code")
    if not isinstance(integrity, dict) and errors is None:
        return ""
    parts = ["<h2>Integrity and errors</h2>"]
    grpc = (result.get("workload") or {}).get("grpc")
    if isinstance(grpc, dict) and not grpc.get("index_field"):
        parts.append('<p class="note">Not checked: the output\'s positions are unknown '
                     '(bench with --index-field).</p>')
        integrity = None
    if isinstance(integrity, dict):
        names = [n for n in INTEGRITY if n in integrity] + [
            n for n in integrity if n not in INTEGRITY]
        parts.append(_table(("check (must be 0)", "count"), ((n, integrity[n]) for n in names),
                            bad=lambda i, v: i == 1 and isinstance(v, (int, float)) and v != 0))
    if errors:
        first = result.get("first_error_by_code") or {}
        parts.append(_table(("error code", "requests", "first message"),
                            ((code, n, first.get(code, "")) for code, n in
                             sorted(errors.items(), key=lambda kv: -kv[1])),
                            bad=lambda i, v: i == 1))
    elif errors is not None:
        parts.append('<p class="ok">No request failed.</p>')
    return "".join(parts)


def _client(result: dict) -> str:
    client = result.get("client")
    if not isinstance(client, dict) or not client:
        return ""
    share = client.get("busiest_process_cpu_share")
    rows = [("load processes", client.get("processes")), ("CPU (s)", client.get("cpu_s")),
            ("CPU per chunk (µs)", client.get("cpu_per_chunk_us")),
            ("busiest process, share of a core",
             _Raw(f"{share:.0%}") if isinstance(share, (int, float)) else None)]
    rows += [(k, v) for k, v in client.items()
             if k not in ("processes", "cpu_s", "cpu_per_chunk_us", "busiest_process_cpu_share")]
    warn = ""
    if isinstance(share, (int, float)) and share > 0.8:
        warn = ('<p class="finding">The busiest load process used over 80 % of a core: the '
                "client may be the bottleneck (more <code>--procs</code>).</p>")
    return "<h2>Client CPU</h2>" + _table(("", "value"), rows) + warn


def _workers(result: dict) -> str:
    workers = [w for w in result.get("workers") or [] if isinstance(w, dict)]
    if not workers:
        return ""
    rows = [(w.get("worker"), w.get("device") or "", w.get("steps"), w.get("step_ms_p50"),
             w.get("step_ms_p90"), w.get("sequences_per_step_p50"), w.get("tokens_per_s"),
             w.get("token_share"), w.get("itl_ms_p50")) for w in workers]
    return "<h2>Workers</h2>" + _table(
        ("worker", "device", "steps", "step p50 (ms)", "step p90 (ms)", "sequences per step",
         "tokens/s", "share of tokens", "its streams' ITL p50 (ms)"), rows)


def _system(result: dict) -> str:
    system = result.get("system")
    if not isinstance(system, dict):
        return ""
    parts = ["<h2>System</h2>"]
    loop = result.get("front_loop")
    if isinstance(loop, dict) and loop.get("samples"):
        parts.append(_table(("front event loop (timed streams)", "value"), (
            ("timer wake-ups", loop["samples"]),
            ("more than 20 ms late", loop["late_over_20ms"]),
            ("lag p99 at most (ms)", loop["p99_ms_at_most"]),
            ("lag max at most (ms)", loop["max_ms_at_most"]))))
    for flag in system.get("flags") or []:
        parts.append(f'<div class="finding">{_esc(flag)}</div>')
    processes = system.get("processes") or {}
    if processes:
        rows = [(name, (p or {}).get("pid"), (p or {}).get("cpu_pct_mean"),
                 (p or {}).get("cpu_pct_max"), len((p or {}).get("samples") or []))
                for name, p in processes.items()]
        parts.append(_table(("process", "pid", "CPU % mean", "CPU % max", "samples"), rows,
                            bad=lambda i, v: i in (2, 3) and _finite(v) and v >= 90))
        parts.append('<p class="note">100 % is one core busy.</p>')
    gpus = system.get("gpus")
    if gpus:
        parts.append("<h3>Cards</h3>" + _generic_rows(gpus))
    scraped = system.get("server_metrics")
    if isinstance(scraped, dict):
        parts.append(_server_metrics(scraped))
        parts.append(_startup(scraped))
    others = {k: v for k, v in system.items()
              if k not in ("processes", "gpus", "flags", "server_metrics")}
    if others:
        parts.append(_kv_table(others))
    if len(parts) == 1:
        parts.append('<p class="note">No system samples.</p>')
    return "".join(parts)


_SERVER_METRICS = (
    ("deepest request buffer (steps)", "peaks", "cadence_deepest_buffer_steps"),
    ("active streams", "peaks", "cadence_active_streams"),
    ("steps merged", "during_run", "cadence_merged_steps_total"),
    ("buffer overflows", "during_run", "cadence_buffer_overflows_total"),
    ("sequence pauses (--overflow block)", "during_run", "cadence_sequence_pauses_total"),
    ("sequences paused at once", "peaks", "cadence_paused_sequences"),
)
"""(row, part of server_metrics, metric): the backpressure the server's own metrics saw."""


def _server_metrics(scraped: dict) -> str:
    """The scraped /metrics: peaks of the gauges, counters' growth over the run."""
    rows = []
    for label, part, name in _SERVER_METRICS:
        value = (scraped.get(part) or {}).get(name)
        if value is not None:  # older results lack the newer metrics
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # counts, shown as counts
            rows.append((label, "peak" if part == "peaks" else "during the run", value))
    loop = scraped.get("front_loop")
    if loop and loop["samples"]:
        rows.append(("front event loop late > 20 ms (samples)", "during the run",
                     f"{loop['late_over_20ms']:.0f} of {loop['samples']:.0f}"))
    note = (f'<p class="note">{_esc(scraped.get("scrapes"))} scrapes of '
            f'{_esc(scraped.get("url"))}; peaks are of the scrapes, not of every moment.</p>')
    return "<h3>Server metrics</h3>" + _table(("metric", "", "value"), rows) + note


def _startup(scraped: dict) -> str:
    """A start-up row per worker: model load, warm-up, the cold first step against a warm one
    (ms), and restarts; empty for a server that exported none (or an older result)."""
    rows = []
    for w in worker_startup(scraped):
        if w["load_s"] is None:
            continue  # restarts only: nothing measured of this worker's start
        ms = [None if w[k] is None else w[k] * 1e3
              for k in ("load_s", "warmup_s", "first_step_s", "warm_step_s")]
        restarts = None if w["restarts"] is None else int(w["restarts"])
        during = None if w["restarts_during_run"] is None else int(w["restarts_during_run"])
        rows.append((f"worker {w['worker']}", *ms, restarts, during))
    if not rows:
        return ""
    note = ('<p class="note">Before the run, so in none of the latencies above: the last start '
            "of each worker (a restarted worker shows its new start). The server turns SERVING "
            "after the warm-up.</p>")
    return ("<h3>Worker start-up</h3>"
            + _table(("start-up", "load (ms)", "warm-up (ms)", "first step (ms)",
                      "warm step (ms)", "restarts", "during the run"), rows,
                     bad=lambda i, v: i == 6 and isinstance(v, int) and v > 0)
            + note)


def _generic_rows(items: Any) -> str:
    """A list of dicts as a table (list values shown by their length), anything else as JSON."""
    if isinstance(items, list) and items and all(isinstance(x, dict) for x in items):
        keys: list[str] = []
        for x in items:
            keys += [k for k in x if k not in keys]
        return _table(keys, ([_cell(x.get(k)) for k in keys] for x in items))
    return f"<pre>{_esc(json.dumps(items, indent=1, default=str)[:4000])}</pre>"


def _cell(value: Any) -> Any:
    if isinstance(value, list):
        return _Raw(f"{len(value)} values")
    return value


def _diagnosis(result: dict) -> str:
    if "diagnosis" not in result:
        return ""
    findings = result.get("diagnosis") or []
    if not findings:
        return '<h2>Diagnosis</h2><p class="ok">No rule fired.</p>'
    parts = ["<h2>Diagnosis</h2>"]
    for f in findings:
        if not isinstance(f, dict):
            parts.append(f'<div class="finding">{_esc(f)}</div>')
            continue
        details = "".join(f"<dt>{_esc(label)}</dt><dd>{_evidence(f[key])}</dd>"
                          for key, label in (("evidence", "evidence"), ("look_at", "look at"))
                          if f.get(key))
        parts.append(f'<div class="finding"><div><span class="rule">{_esc(f.get("rule", "?"))}'
                     f"</span>: {_esc(f.get('finding', ''))}</div><dl>{details}</dl></div>")
    return "".join(parts)


def _evidence(value: Any) -> str:
    """A finding's evidence: text as it is, a dict of numbers as `name value` pairs."""
    if isinstance(value, dict):
        return ", ".join(f"{_esc(k)} <b>{fmt(v)}</b>" for k, v in value.items())
    return _esc(value)


def _baseline(result: dict) -> str:
    baseline = result.get("baseline")
    if not isinstance(baseline, dict) or not baseline:
        return ""
    if baseline.get("error"):
        return ("<h2>Against the engine-only baseline</h2>"
                f'<p class="note">No baseline: {_esc(baseline["error"])}</p>')
    names = aggregate_names(baseline)
    rows = []
    for n in names:
        run, base = result.get(n) or {}, baseline[n]
        row: list[Any] = [n]
        for stat in ("p50", "p99"):
            r, b = run.get(stat), base.get(stat)
            delta = r - b if _finite(r) and _finite(b) else None
            row += [r, b, delta]
        rows.append(row)
    parts = ["<h2>Against the engine-only baseline</h2>"]
    if rows:
        parts.append(_table(("metric", "run p50", "baseline p50", "Δ p50",
                             "run p99", "baseline p99", "Δ p99"), rows))
    extra = [(label, result.get(key), baseline[key]) for key, label in THROUGHPUT
             if key in baseline]
    if extra:
        parts.append(_table(("", "run", "baseline"), extra))
    overhead = result.get("overhead_ms")
    if isinstance(overhead, dict) and overhead:
        rows = [(m, *(_signed((d or {}).get(s)) for s in STATS)) for m, d in overhead.items()]
        parts.append("<h3>Serving overhead (served − engine-only, ms)</h3>"
                     + _table(("metric", *STATS), rows))
    return "".join(parts)


def _signed(value: Any) -> _Raw:
    return _Raw(f"{value:+.2f}" if _finite(value) else "—")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# -- plots ----------------------------------------------------------------------------------


def _figure(path: Path | None, caption: str) -> str:
    if path is None:
        return ""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_esc(caption)}">'
            f"<figcaption>{_esc(caption)}</figcaption></figure>")


def _run_plots(result: dict, out_dir: Path, prefix: str = "") -> tuple[str, list[Path]]:
    """The plots of one run: (HTML, the PNGs written)."""
    parts, written = [], []
    raw = result.get("records")
    records = []
    if raw:
        try:
            records = plots.decode_records(raw)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            # a malformed record must not cost the rest of the report
            parts.append(f'<p class="note">Records could not be read ({_esc(exc)}): no '
                         "per-request plots.</p>")
    elif raw is not None or _is_distribution(result.get("ttft_ms")):
        parts.append('<p class="note">No raw records in this result: no CDF or ITL-over-time '
                     "plots.</p>")
    jobs = [
        ("ttft_cdf.png", lambda p: plots.plot_ttft_cdf(records, p),
         "TTFT CDF over OK requests; dotted/dashed lines at p50, p90, p99."),
        ("itl_cdf.png", lambda p: plots.plot_itl_cdf(records, p),
         "ITL CDF: one value per chunk after the first, its gap over its tokens."),
        ("itl_over_time.png", lambda p: plots.plot_itl_over_time(records, p),
         ("Per-chunk ITL of 5 streams (the one with the worst ITL and 4 spread over the run) "
          "against time since the first request was sent.")),
        ("segments.png", lambda p: plots.plot_segments(result.get("segments_ms"), p,
                                                       result.get("ttft_segments_ms")),
         "Segments stacked at p50 and p99 (a sum of p99s is not the p99 of the sum)."),
        ("workers.png", lambda p: plots.plot_worker_curves(result.get("workers"), p),
         ("Each worker's output curve over the run: step time, this run's sequences per "
          "step, tokens per second (0.25 s windows).")),
        ("cpu.png", lambda p: plots.plot_cpu(result.get("system"), p),
         ("CPU % per process over the run (100 % = one core), and card utilisation when "
          "cards were sampled.")),
    ]
    for name, draw, caption in jobs:
        path = draw(out_dir / f"{prefix}{name}")
        if path is not None:
            written.append(path)
            parts.append(_figure(path, caption))
    return "".join(parts), written


# -- sweeps ---------------------------------------------------------------------------------

_SWEEP_COLUMNS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "mean"), ("itl_ms", "p90"),
                  ("tokens_per_s", None))


def _spread_cell(repeats: Sequence[dict], name: str, stat: str | None) -> _Raw:
    mean, low, high = plots.spread(repeats, name, stat)
    if not math.isfinite(mean):
        return _Raw("—")
    if len(repeats) > 1 and high > low:
        return _Raw(f"{fmt(mean)} <span class='note'>[{fmt(low)}–{fmt(high)}]</span>")
    return _Raw(fmt(mean))


def _sum_dicts(dicts: Iterable[Any]) -> Counter:
    total: Counter = Counter()
    for d in dicts:
        if isinstance(d, dict):
            total.update({k: v for k, v in d.items() if isinstance(v, (int, float))})
    return total


def _sweep(result: dict, out_dir: Path) -> tuple[str, list[Path]]:
    sweep = result.get("sweep")
    if not isinstance(sweep, dict):
        return "", []
    variable = str(sweep.get("variable", "value"))
    points = plots.sweep_points(sweep)
    parts = [f"<h2>Sweep over {_esc(variable)}</h2>"]
    if not points:
        return parts[0] + '<p class="note">The sweep has no points.</p>', []
    header = (variable, "repeats", "requests OK", *(f"{n} {s}" if s else n for n, s in _SWEEP_COLUMNS),
              "errors", "integrity")
    rows = []
    for p in points:
        repeats = [r for r in p.get("repeats") or [] if isinstance(r, dict)]
        ok = sum(r.get("requests_ok", 0) or 0 for r in repeats)
        total = sum(r.get("requests", 0) or 0 for r in repeats)
        errors = _sum_dicts(r.get("errors_by_code") for r in repeats)
        broken = sum(_sum_dicts(r.get("integrity") for r in repeats).values())
        rows.append((_Raw(_esc(p.get("value"))), len(repeats), _Raw(f"{ok}/{total}"),
                     *(_spread_cell(repeats, n, s) for n, s in _SWEEP_COLUMNS),
                     _Raw(_esc(", ".join(f"{k} {v}" for k, v in errors.items())) or "none"),
                     broken))
    parts.append(_table(header, rows, bad=lambda i, v: i == len(header) - 1 and v != 0))
    parts.append('<p class="note">Mean over repeats, [lowest–highest] when they differ.</p>')
    failures = [(p.get("value"), text) for p in points for text in p.get("failures") or []]
    if failures:
        parts.append("<h3>Runs that failed</h3>")
        parts.append(_table((variable, "why"), failures, bad=lambda i, v: i == 1))
    settings = {k: v for k, v in sweep.items() if k in ("serve_args", "server_cmd", "repeat")}
    if isinstance(settings.get("serve_args"), list):
        settings["serve_args"] = " ".join(map(str, settings["serve_args"]))
    if settings:
        parts.append(_kv_table(settings))
    written = []
    path = plots.plot_sweep(sweep, out_dir / "sweep.png")
    if path is not None:
        written.append(path)
        parts.append(_figure(path, f"TTFT, ITL and throughput against {variable}: markers at "
                                   "the mean over repeats, bars from the lowest to the highest."))
    for p in points:
        repeats = [r for r in p.get("repeats") or [] if isinstance(r, dict)]
        parts.append(f"<details><summary>{_esc(variable)} = {_esc(p.get('value'))} "
                     f"({len(repeats)} repeats)</summary>{_point_detail(repeats)}</details>")
    return "".join(parts), written


def _point_detail(repeats: Sequence[dict]) -> str:
    """One sweep point: every aggregate as the mean over repeats, with the range."""
    if not repeats:
        return '<p class="note">No repeats.</p>'
    names: list[str] = []
    for r in repeats:
        names += [n for n in aggregate_names(r) if n not in names]
    rows = [(n, *(_spread_cell(repeats, n, s) for s in STATS)) for n in names]
    rows += [(f"segment {n}", *(_spread_cell([r.get("segments_ms") or {} for r in repeats], n, s)
                                for s in STATS))
             for n in _names_in(r.get("segments_ms") for r in repeats)]
    cpu = [((r.get("system") or {}).get("processes") or {}) for r in repeats]
    cpu_rows = [(f"CPU % {n}", _spread_cell(cpu, n, "cpu_pct_mean"),
                 _spread_cell(cpu, n, "cpu_pct_max")) for n in _names_in(cpu)]
    parts = [_table(("metric", *STATS), rows)]
    if cpu_rows:
        parts.append(_table(("process", "CPU % mean", "CPU % max"), cpu_rows))
    for i, r in enumerate(repeats):
        if "diagnosis" in r:
            findings = r.get("diagnosis") or []
            text = "; ".join(f"{f.get('rule', '?')}: {f.get('finding', '')}" if isinstance(f, dict)
                             else str(f) for f in findings) or "no rule fired"
            parts.append(f'<p class="note">repeat {i + 1} diagnosis: {_esc(text)}</p>')
    return "".join(parts)


def _names_in(dicts: Iterable[Any]) -> list[str]:
    """The keys of several dicts, in first-seen order."""
    names: list[str] = []
    for d in dicts:
        names += [n for n in (d if isinstance(d, dict) else {}) if n not in names]
    return names


# -- the report -----------------------------------------------------------------------------


def render_report(result: dict, out_dir: Path, title: str | None = None) -> Path:
    """Write the plots and `report.html` for `result` into `out_dir`; return the HTML's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = result.get("workload")
    if not isinstance(workload, dict):
        workload = _first_repeat(result).get("workload")
    target = workload.get("target") if isinstance(workload, dict) else None
    title = title or (f"cadence report: {target}" if target else "cadence report")
    plots_html, _ = _run_plots(result, out_dir)
    sweep_html, _ = _sweep(result, out_dir)
    body = [
        f"<h1>{_esc(title)}</h1>",
        _workload(result),
        _diagnosis(result),
        _throughput(result),
        _aggregates(result),
        _segments(result),
        _integrity(result),
        _client(result),
        _workers(result),
        _system(result),
        _baseline(result),
        f"<h2>Plots</h2>{plots_html}" if plots_html else "",
        sweep_html,
    ]
    if not any(body[1:]):
        body.append('<p class="note">This result holds nothing the report knows how to show.</p>')
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(part for part in body if part)
        + "</body></html>\n"
    )
    path = out_dir / REPORT_NAME
    path.write_text(page, encoding="utf-8")
    return path
