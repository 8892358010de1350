"""The report of one `cadence bench` result, and `render_report`, which writes the page for a
run or a sweep.

`render_report` writes the plots as PNGs into the output folder and one `report.html` that
embeds them, with inline CSS and no external resource. Every optional part of a result
(records, segments, system, diagnosis, baseline, run metadata, sweep) may be missing.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import msgspec

from cadence.lab.measure.scrape import worker_startup
from cadence.lab.report import plots, sweep
from cadence.lab.report.html import (
    Raw,
    esc,
    figure,
    finite,
    fmt,
    kv_table,
    note,
    page,
    section,
    table,
)
from cadence.lab.report.integrity import CHECKS, counted_checks
from cadence.lab.report.plots import STATS, aggregate_names, is_distribution
from cadence.lab.report.summary import overhead

THROUGHPUT = (
    ("requests", "requests"), ("requests_ok", "requests OK"), ("wall_s", "wall (s)"),
    ("output_tokens", "output tokens"), ("chunks", "chunks"), ("requests_per_s", "requests/s"),
    ("tokens_per_s", "tokens/s"), ("chunks_per_s", "chunks/s"),
)
REPORT_NAME = "report.html"
RUN_FIELDS = (
    ("started_at", "started (UTC)"), ("host", "host"), ("cpu_count", "CPUs"),
    ("cadence_version", "cadence"), ("grpcio_version", "grpcio"), ("python_version", "Python"),
    ("server_cmdline", "server command line"),
)
"""The rows of a result's `run` metadata, in order."""


# -- sections of one run ---------------------------------------------------------------------


def _run(result: dict, title: str = "Run") -> str:
    """When, where and with what the run was made; "" for a result without `run`."""
    run = result.get("run")
    if not isinstance(run, dict):
        return ""
    rows = []
    for key, label in RUN_FIELDS:
        value = run.get(key)
        if key == "server_cmdline":
            value = Raw(f"<code>{esc(shlex.join(map(str, value)))}</code>") if value else \
                "not known (a server the lab neither started nor found on this host)"
        rows.append((label, value))
    rows += [(k, v) for k, v in run.items() if k not in dict(RUN_FIELDS)]
    return section(title, table(("", "value"), rows))


def _aborted(result: dict) -> str:
    reason = result.get("aborted")
    if not reason:
        return ""
    return f'<div class="finding"><span class="rule">The bench stopped early</span>: {esc(reason)}</div>'


_UNSET_GRPC_FIELDS = {
    "tokens_field": "not given: one token per message",
    "index_field": "not given: positions unknown, so integrity is not checked",
}


def _workload_rows(workload: dict) -> list[tuple[str, Any]]:
    """The workload as rows: a nested part (`grpc`, `openai`) as `part.key` rows, lists of
    numbers joined, JSON templates as code."""
    rows: list[tuple[str, Any]] = []
    for key, value in workload.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if v is None and key == "grpc" and sub in _UNSET_GRPC_FIELDS:
                    v = _UNSET_GRPC_FIELDS[sub]
                rows.append((f"{key}.{sub}", _readable(v)))
        else:
            rows.append((key, _readable(value)))
    return rows


def _readable(value: Any) -> Any:
    if isinstance(value, list):
        return ", ".join(map(str, value)) if value else "none"
    if isinstance(value, str) and value.lstrip().startswith("{"):
        return Raw(f"<code>{esc(value)}</code>")
    return value


def _workload(result: dict, title: str = "Workload") -> str:
    workload = result.get("workload")
    if not isinstance(workload, dict):
        return ""
    return section(title, table(("", "value"), _workload_rows(workload)))


def _throughput(result: dict) -> str:
    rows = [(label, result[key]) for key, label in THROUGHPUT if key in result]
    return section("Requests and throughput", table(("", "value"), rows))


def _aggregates(result: dict) -> str:
    rows = [(n, result[n].get("count"), *(result[n].get(s) for s in STATS))
            for n in aggregate_names(result)]
    if not rows:
        return ""
    return section("Latency and chunk aggregates", table(("metric", "count", *STATS), rows),
                   note("ms unless the name says otherwise; chunk_tokens is tokens per chunk. "
                        "Definitions: cadence.lab.analysis.stats."))


def _segment_table(segments: Any, names: Any, share: dict | None) -> str:
    if not isinstance(segments, dict):
        return ""
    rows = [(n, d.get("count"), d.get("mean"), d.get("p50"), d.get("p99"), _share(share, n))
            for n in names if isinstance(d := segments.get(n), dict)]
    return table(("segment (ms)", "count", "mean", "p50", "p99", "share of the mean"), rows)


def _segments(result: dict, figure_html: str) -> str:
    """TTFT's parts (one per request) and a token's parts (one per chunk) apart: their means
    add up to the mean of their whole, their percentiles do not."""
    segments, first = result.get("segments_ms"), result.get("ttft_segments_ms")
    shares = result.get("segment_shares") or {}
    ttft = _segment_table(first, plots.TTFT_SEGMENTS, shares.get("ttft"))
    if not ttft:  # an older result: the per-request parts of segments_ms alone
        ttft = _segment_table(segments, plots.SEGMENT_ORDER[:2], None)
    token = _segment_table(segments, plots.SEGMENT_ORDER[2:], shares.get("token"))
    return section(
        "Where the time goes",
        section("Time to first token, per request", ttft,
                note("client_to_front and queue before the first step; its means add up to "
                     "the mean TTFT of the timed requests.") if ttft else "", level=3),
        section("A token's path, per chunk", token,
                note("From the start of the engine step that made the chunk's first token to "
                     "the client; its means add up to the mean of that path.") if token else "",
                level=3),
        figure_html if (ttft or token) else "",
    )


def _share(d: dict | None, name: str) -> Raw:
    v = (d or {}).get(name)
    return Raw(f"{v:.1%}" if finite(v) else "—")


def _integrity(result: dict) -> str:
    integrity = result.get("integrity")
    errors = result.get("errors_by_code")
    checks = counted_checks(result.get("workload"))
    parts = []
    if isinstance(integrity, dict):
        if not checks:
            parts.append(note("Integrity not checked: the output's positions are unknown "
                              "(bench with --index-field)."))
        names = [n for n in CHECKS if n in checks and n in integrity]
        names += [n for n in integrity if n not in CHECKS]
        parts.append(table(("check (must be 0)", "count"), ((n, integrity[n]) for n in names),
                           bad=lambda i, v: i == 1 and isinstance(v, (int, float)) and v != 0))
        if "short_streams" in integrity and "short_streams" not in checks and checks:
            parts.append(note("short_streams not counted: the protocol does not say why a "
                              "stream ended."))
    if errors:
        first = result.get("first_error_by_code") or {}
        parts.append(table(("error code", "requests", "first message"),
                           ((code, n, first.get(code, "")) for code, n in
                            sorted(errors.items(), key=lambda kv: -kv[1])),
                           bad=lambda i, v: i == 1))
    elif errors is not None:
        parts.append('<p class="ok">No request failed.</p>')
    return section("Integrity and errors", *parts)


def _client(result: dict) -> str:
    client = result.get("client")
    if not isinstance(client, dict) or not client:
        return ""
    share = client.get("busiest_process_cpu_share")
    known = ("processes", "cpu_s", "cpu_per_chunk_us", "busiest_process_cpu_share")
    rows = [("load processes", client.get("processes")), ("CPU (s)", client.get("cpu_s")),
            ("CPU per chunk (µs)", client.get("cpu_per_chunk_us")),
            ("busiest process, share of a core", Raw(f"{share:.0%}") if finite(share) else None)]
    rows += [(k, _distribution_cell(v) if is_distribution(v) else v)
             for k, v in client.items() if k not in known]
    warn = ""
    if finite(share) and share > 0.8:
        warn = ('<p class="finding">The busiest load process used over 80 % of a core: the '
                "client may be the bottleneck (more <code>--procs</code>).</p>")
    return section("Client", table(("", "value"), rows), warn)


def _distribution_cell(d: dict) -> Raw:
    """A distribution in one cell: its p50, p99 and max."""
    return Raw(", ".join(f"{s} {fmt(d.get(s))}" for s in ("p50", "p99", "max")))


def _workers(result: dict) -> str:
    workers = [w for w in result.get("workers") or [] if isinstance(w, dict)]
    rows = [(w.get("worker"), w.get("device") or "", w.get("steps"), w.get("step_ms_p50"),
             w.get("step_ms_p90"), w.get("sequences_per_step_p50"), w.get("tokens_per_s"),
             w.get("token_share"), w.get("itl_ms_p50")) for w in workers]
    return section("Workers", table(
        ("worker", "device", "steps", "step p50 (ms)", "step p90 (ms)", "sequences per step",
         "tokens/s", "share of tokens", "its streams' ITL p50 (ms)"), rows))


def _system(result: dict) -> str:
    system = result.get("system")
    if not isinstance(system, dict):
        return ""
    parts = []
    loop = result.get("front_loop")
    if isinstance(loop, dict) and loop.get("samples"):
        parts.append(table(("front event loop (timed streams)", "value"), (
            ("timer wake-ups", loop["samples"]),
            ("more than 20 ms late", loop["late_over_20ms"]),
            ("lag p99 at most (ms)", loop["p99_ms_at_most"]),
            ("lag max at most (ms)", loop["max_ms_at_most"]))))
    parts += [f'<div class="finding">{esc(flag)}</div>' for flag in system.get("flags") or []]
    processes = system.get("processes") or {}
    rows = [(name, (p or {}).get("pid"), (p or {}).get("cpu_pct_mean"),
             (p or {}).get("cpu_pct_max"), len((p or {}).get("samples") or []))
            for name, p in processes.items()]
    cpu = table(("process", "pid", "CPU % mean", "CPU % max", "samples"), rows,
                bad=lambda i, v: i in (2, 3) and finite(v) and v >= 90)
    parts += [cpu, note("100 % is one core busy.") if cpu else ""]
    parts.append(section("Cards", _generic_rows(system.get("gpus")), level=3))
    scraped = system.get("server_metrics")
    if isinstance(scraped, dict):
        parts += [_server_metrics(scraped), _startup(scraped)]
    parts.append(kv_table({k: v for k, v in system.items()
                           if k not in ("processes", "gpus", "flags", "server_metrics")}))
    return section("System", *parts)


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
    metrics = table(("metric", "", "value"), rows)
    return section("Server metrics", metrics, note(
        f"{scraped.get('scrapes')} scrapes of {scraped.get('url')}; peaks are of the scrapes, "
        "not of every moment.") if metrics else "", level=3)


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
    startup = table(("start-up", "load (ms)", "warm-up (ms)", "first step (ms)",
                     "warm step (ms)", "restarts", "during the run"), rows,
                    bad=lambda i, v: i == 6 and isinstance(v, int) and v > 0)
    return section("Worker start-up", startup, note(
        "Before the run, so in none of the latencies above: the last start of each worker (a "
        "restarted worker shows its new start). The server turns SERVING after the warm-up."
    ) if startup else "", level=3)


def _generic_rows(items: Any) -> str:
    """A list of dicts as a table (list values shown by their length), anything else but
    nothing as JSON."""
    if not items:
        return ""
    if isinstance(items, list) and all(isinstance(x, dict) for x in items):
        keys = list(dict.fromkeys(k for x in items for k in x))
        return table(keys, ([_cell(x.get(k)) for k in keys] for x in items))
    return f"<pre>{esc(json.dumps(items, indent=1, default=str)[:4000])}</pre>"


def _cell(value: Any) -> Any:
    return Raw(f"{len(value)} values") if isinstance(value, list) else value


def _diagnosis(result: dict) -> str:
    if "diagnosis" not in result:
        return ""
    findings = result.get("diagnosis") or []
    if not findings:
        return '<h2>Diagnosis</h2><p class="ok">No rule fired.</p>'
    parts = []
    for f in findings:
        if not isinstance(f, dict):
            parts.append(f'<div class="finding">{esc(f)}</div>')
            continue
        details = "".join(f"<dt>{esc(label)}</dt><dd>{_evidence(f[key])}</dd>"
                          for key, label in (("evidence", "evidence"), ("look_at", "look at"))
                          if f.get(key))
        parts.append(f'<div class="finding"><div><span class="rule">{esc(f.get("rule", "?"))}'
                     f"</span>: {esc(f.get('finding', ''))}</div><dl>{details}</dl></div>")
    return section("Diagnosis", *parts)


def _evidence(value: Any) -> str:
    """A finding's evidence: text as it is, a dict of numbers as `name value` pairs."""
    if isinstance(value, dict):
        return ", ".join(f"{esc(k)} <b>{fmt(v)}</b>" for k, v in value.items())
    return esc(value)


def _baseline(result: dict) -> str:
    baseline = result.get("baseline")
    if not isinstance(baseline, dict) or not baseline:
        return ""
    title = "Against the engine-only baseline"
    if baseline.get("error"):
        return section(title, note(f"No baseline: {baseline['error']}"))
    rows = []
    for n in aggregate_names(baseline):
        run, base = result.get(n) or {}, baseline[n]
        row: list[Any] = [n]
        for stat in ("p50", "p99"):
            r, b = run.get(stat), base.get(stat)
            row += [r, b, overhead_cell(r - b if finite(r) and finite(b) else None)]
        rows.append(row)
    extra = [(label, result.get(key), baseline[key]) for key, label in THROUGHPUT
             if key in baseline]
    overhead = result.get("overhead_ms")
    rows_overhead = [(m, *(overhead_cell((d or {}).get(s)) for s in STATS))
                     for m, d in overhead.items()] if isinstance(overhead, dict) else []
    return section(
        title,
        table(("metric", "run p50", "baseline p50", "Δ p50", "run p99", "baseline p99",
               "Δ p99"), rows),
        table(("", "run", "baseline"), extra),
        section("Serving overhead (served − engine-only, ms)",
                table(("metric", *STATS), rows_overhead),
                note("An overhead below zero is the noise of two runs, not a gain: shown as "
                     "within noise.") if rows_overhead else "", level=3),
    )


def overhead_cell(value: Any) -> Raw:
    return Raw(esc(overhead(value)))


# -- plots ----------------------------------------------------------------------------------


def _records(result: dict) -> tuple[list, str]:
    """The result's raw records and a note on why there are none."""
    raw = result.get("records")
    if raw:
        try:
            return plots.decode_records(raw), ""
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            # a malformed record must not cost the rest of the report
            return [], note(f"Records could not be read ({exc}): no per-request plots.")
    if raw is not None or is_distribution(result.get("ttft_ms")):
        return [], note("No raw records in this result: no CDF or ITL-over-time plots.")
    return [], ""


def _plots(result: dict, out_dir: Path) -> str:
    """The plots of one run besides the segments'."""
    records, why_none = _records(result)
    jobs = [
        ("ttft_cdf.png", lambda p: plots.plot_ttft_cdf(records, p),
         "TTFT CDF over OK requests; dotted/dashed lines at p50, p90, p99."),
        ("itl_cdf.png", lambda p: plots.plot_itl_cdf(records, p),
         "ITL CDF: one value per chunk after the first, its gap over its tokens."),
        ("itl_over_time.png", lambda p: plots.plot_itl_over_time(records, p),
         ("Per-chunk ITL of 5 streams (the one with the worst ITL and 4 spread over the run) "
          "against time since the first request was sent.")),
        ("workers.png", lambda p: plots.plot_worker_curves(result.get("workers"), p),
         ("Each worker's output curve over the run: step time, this run's sequences per "
          "step, tokens per second (0.25 s windows).")),
        ("cpu.png", lambda p: plots.plot_cpu(result.get("system"), p),
         ("CPU % per process over the run (100 % = one core), and card utilisation when "
          "cards were sampled.")),
    ]
    return section("Plots", why_none,
                   *(figure(draw(out_dir / name), caption) for name, draw, caption in jobs))


def _segment_figure(result: dict, out_dir: Path) -> str:
    path = plots.plot_segments(plots.segment_stacks(result), out_dir / "segments.png")
    return figure(path, "Segment means, stacked: a request's TTFT, and a chunk's path from its "
                        "step's start to the client, each on its own axis.")


# -- the report -----------------------------------------------------------------------------


def _run_sections(result: dict, out_dir: Path) -> list[str]:
    return [
        _aborted(result),
        _run(result),
        _workload(result),
        _diagnosis(result),
        _throughput(result),
        _aggregates(result),
        _segments(result, _segment_figure(result, out_dir)),
        _integrity(result),
        _client(result),
        _workers(result),
        _system(result),
        _baseline(result),
        _plots(result, out_dir),
    ]


def render_report(result: dict, out_dir: Path, title: str | None = None,
                  source: str = "") -> Path:
    """Write the plots and `report.html` for `result` (a bench result, or `{"sweep": ...}`)
    into `out_dir`; return the HTML's path. The title says what was measured (the target, or
    what the sweep varied) unless given; `source` names the file read, under it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    swept = result.get("sweep")
    if isinstance(swept, dict):
        first = sweep.first_repeat(swept)
        title = title or sweep.title(swept)
        parts = [_workload(first, "Workload (of the sweep's first run)"),
                 _run(first, "Run (the sweep's first)"),
                 sweep.sweep_section(swept, out_dir)]
    else:
        target = (result.get("workload") or {}).get("target")
        title = title or (f"cadence bench: {target}" if target else "cadence report")
        parts = _run_sections(result, out_dir)
    if not any(parts):
        parts.append(note("This result holds nothing the report knows how to show."))
    path = out_dir / REPORT_NAME
    path.write_text(page(title, f"from {source}" if source else "", parts), encoding="utf-8")
    return path
