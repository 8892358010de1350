"""The report of one `cadence bench` result, and `render_report`, which writes the page for a
run or a sweep.

`render_report` writes the plots as PNGs into the output folder and one `report.html` that
embeds them, with inline CSS and no external resource. It reads a typed result
(`cadence.lab.results`); every part that only some runs have (records, segments, workers,
baseline, run metadata) may be missing.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import msgspec

from cadence.lab.analysis.goodput import terms_words
from cadence.lab.analysis.integrity import CHECKS, counted_checks
from cadence.lab.analysis.server_spans import SPLIT
from cadence.lab.analysis.startup import worker_startup
from cadence.lab.analysis.verdict import HEALTHY, TAIL_WORDS, cause_words
from cadence.lab.records import RequestRecord
from cadence.lab.report import plots, sweep
from cadence.lab.report.html import Raw, esc, figure, finite, fmt, note, page, section, table
from cadence.lab.report.plots import STATS, aggregate_names, field
from cadence.lab.report.summary import (
    ROLE_WORDS,
    label_words,
    overhead,
    role_value,
    run_verdict,
    saturation_line,
)
from cadence.lab.results import (
    BenchResult,
    Distribution,
    EngineOnly,
    ServerMetrics,
    SweepResult,
    System,
)
from cadence.wording import counted

THROUGHPUT = (
    ("requests", "requests"),
    ("requests_ok", "requests OK"),
    ("wall_s", "wall (s)"),
    ("output_tokens", "output tokens"),
    ("chunks", "chunks"),
    ("requests_per_s", "requests/s"),
    ("tokens_per_s", "tokens/s"),
    ("chunks_per_s", "chunks/s"),
)
REPORT_NAME = "report.html"
RUN_FIELDS = (
    ("started_at", "started (UTC)"),
    ("host", "host"),
    ("cpu_count", "CPUs"),
    ("cadence_version", "cadence"),
    ("grpcio_version", "grpcio"),
    ("python_version", "Python"),
    ("server_cmdline", "server command line"),
    ("server_process", "port served by"),
)
"""The rows of a result's `run` metadata, in order."""


def decode_result(data: dict) -> tuple[BenchResult | SweepResult, str]:
    """The typed result of data read from JSON, and a note when its raw records could not be
    read (a malformed record costs the per-request plots, not the report). Raises
    `msgspec.ValidationError` for anything else that does not fit."""
    if "sweep" in data:
        return msgspec.convert(data, SweepResult), ""
    result = msgspec.convert({k: v for k, v in data.items() if k != "records"}, BenchResult)
    if data.get("records") is not None:
        try:
            result.records = msgspec.convert(data["records"], list[RequestRecord])
        except msgspec.ValidationError as exc:
            return result, f"Records could not be read ({exc}): no per-request plots."
    return result, ""


# -- sections of one run ---------------------------------------------------------------------


def _run(result: BenchResult, title: str = "Run") -> str:
    """When, where and with what the run was made; "" for a result without `run`."""
    run = field(result, "run")
    if run is None:
        return ""
    rows: list[tuple[str, Any]] = []
    for key, label in RUN_FIELDS:
        value = getattr(run, key)
        if key == "server_cmdline":
            value = (
                Raw(f"<code>{esc(shlex.join(value))}</code>")
                if value
                else "not known (a server the lab neither started nor found on this host)"
            )
        rows.append((label, value if value != "" else None))
    return section(title, table(("", "value"), rows))


def _goodput(result: BenchResult) -> str:
    """The run under its SLO (`--slo`); "" without one."""
    goodput = field(result, "goodput")
    if goodput is None:
        return ""
    rows = [
        (name, t.bound_ms, t.measured_ms, "yes" if t.met else "no")
        for name, t in goodput.terms.items()
    ]
    return section(
        "Goodput under the SLO",
        note(
            f"The run {'passes' if goodput.passed else 'fails'} its SLO. Goodput: "
            f"{fmt(goodput.requests_per_s)} requests/s, {fmt(goodput.tokens_per_s)} tokens/s "
            f"({fmt(100 * goodput.good_share)}% of the requests met every term with their own "
            "values)."
        ),
        table(
            ("term", "bound (ms)", "the run's value (ms)", "met"),
            rows,
            bad=lambda column, cell: column == 3 and cell == "no",
        ),
    )


def _http2(result: BenchResult) -> str:
    """The gRPC server's HTTP/2 settings read before the run; "" when not read (HTTP/1)."""
    settings = field(result, "http2")
    if settings is None:
        return ""
    if settings.error:
        return section("Server's HTTP/2 settings", note(f"Not read: {settings.error}"))
    rows = [
        ("TLS", "yes" if settings.tls else "no"),
        (
            "max concurrent streams per connection",
            settings.max_concurrent_streams
            if settings.max_concurrent_streams is not None
            else "no limit",
        ),
        ("initial window (bytes)", settings.initial_window_size or "65,535 (default)"),
        ("max frame size (bytes)", settings.max_frame_size or "16,384 (default)"),
        ("max header list size (bytes)", settings.max_header_list_size or "no limit"),
    ]
    return section("Server's HTTP/2 settings", table(("", "value"), rows))


def _server_threads(result: BenchResult) -> str:
    """The server's threads by name over the run (this host's /proc); "" when not read."""
    threads = field(result, "server_threads")
    if not threads or not threads.groups:
        return ""
    rows = [
        (
            g.name,
            g.threads,
            g.processes,
            g.cpu_pct,
            g.busiest_thread_cpu_pct,
            g.wait_for_cpu_pct,
            g.voluntary_switches_per_s,
            g.involuntary_switches_per_s,
        )
        for g in threads.groups
    ]
    stacks = [
        (g.name, g.threads, g.samples, s.where, s.code, s.count)
        for g in threads.stacks or []
        for s in g.spots
    ]
    return section(
        "Server threads",
        table(
            (
                "thread group",
                "threads",
                "processes",
                "CPU % of a core",
                "busiest thread %",
                "waiting for a CPU %",
                "voluntary switches/s",
                "involuntary switches/s",
            ),
            rows,
        ),
        table(
            (
                "thread group (py-spy)",
                "threads",
                "samples",
                "innermost frame",
                "the server's own code",
                "samples there",
            ),
            stacks,
        ),
        note(
            f"Every thread of the server's {len(threads.processes)} process(es) on this "
            f"host ({threads.cpus} CPUs), over {threads.wall_s:.2f} s; numbers in names "
            "read as N."
        ),
    )


def _aborted(result: BenchResult) -> str:
    reason = field(result, "aborted")
    if not reason:
        return ""
    return (
        f'<div class="finding"><span class="rule">The bench stopped early</span>: '
        f"{esc(reason)}</div>"
    )


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


def _workload(result: BenchResult, title: str = "Workload") -> str:
    if not result.workload.target:
        return ""
    workload = msgspec.to_builtins(result.workload)
    return section(title, table(("", "value"), _workload_rows(workload)))


def _throughput(result: BenchResult) -> str:
    if not result.requests:
        return ""
    rows = [(label, getattr(result, key)) for key, label in THROUGHPUT]
    return section("Requests and throughput", table(("", "value"), rows))


def _aggregates(result: BenchResult) -> str:
    rows = [
        (
            n,
            (d := getattr(result, n)).count,
            *(None if (v := getattr(d, s)) is msgspec.UNSET else v for s in (*STATS, "p999")),
        )
        for n in aggregate_names(result)
    ]
    return section(
        "Latency and chunk aggregates",
        table(("metric", "count", *STATS, "p99.9"), rows),
        note(
            "ms unless the name says otherwise; chunk_tokens is tokens per chunk. "
            "Definitions: cadence.lab.analysis.stats."
        )
        if rows
        else "",
    )


def _segment_table(segments: Any, names: Any, share: dict | None) -> str:
    if segments is None:
        return ""
    rows = [
        (n, d.count, d.mean, d.p50, d.p99, _share(share, n))
        for n in names
        if (d := getattr(segments, n)).count
    ]
    return table(("segment (ms)", "count", "mean", "p50", "p99", "share of the mean"), rows)


def _segments(result: BenchResult, figure_html: str) -> str:
    """TTFT's parts (one per request) and a token's parts (one per chunk) apart: their means
    add up to the mean of their whole, their percentiles do not."""
    segments, first = field(result, "segments_ms"), field(result, "ttft_segments_ms")
    shares = field(result, "segment_shares")
    ttft = _segment_table(first, plots.TTFT_SEGMENTS, shares and shares.ttft)
    if not ttft:  # an older result: the per-request parts of segments_ms alone
        ttft = _segment_table(segments, plots.SEGMENT_ORDER[:2], None)
    token = _segment_table(segments, plots.SEGMENT_ORDER[2:], shares and shares.token)
    return section(
        "Where the time goes",
        section(
            "Time to first token, per request",
            ttft,
            note(
                "client_to_front and queue before the first step; its means add up to "
                "the mean TTFT of the timed requests."
            )
            if ttft
            else "",
            level=3,
        ),
        section(
            "A token's path, per chunk",
            token,
            note(
                "From the start of the engine step that made the chunk's first token to "
                "the client; its means add up to the mean of that path."
            )
            if token
            else "",
            level=3,
        ),
        figure_html if (ttft or token or field(result, "server_spans")) else "",
    )


SLOWEST_SPANS = 10
"""Requests shown with their spans: the slowest to first token."""


def _server_spans(result: BenchResult) -> str:
    """The server's spans joined to the requests (`--otlp-receive`); "" without."""
    spans = field(result, "server_spans")
    if spans is None:
        return ""
    head = note(
        f"{spans.matched} of {spans.sent} requests matched a span the server sent to port "
        f"{spans.port} ({spans.spans_received} spans"
        + (f" from {', '.join(spans.services)}" if spans.services else "")
        + "; "
        f"{counted(spans.foreign_traces, 'trace')} of the server's other work). TTFT splits at the "
        "server span's edges: before it began (network, proxy, accept), inside it (queue and "
        "prefill where the server names them), after the server sent the first output "
        "(the way back); the means add up to the mean TTFT."
        + (
            f" {counted(spans.clock_suspect, 'request')} "
            f"{'shows' if spans.clock_suspect == 1 else 'show'} a span that began before the "
            "request was sent: the server's clock disagrees with this host's."
            if spans.clock_suspect
            else ""
        )
    )
    parts = [
        (name, d.count, d.mean, d.p50, d.p90, d.p99, d.max)
        for name in SPLIT
        if (d := spans.ttft_split_ms.get(name)) is not None
    ]
    slowest = sorted(
        (r for r in spans.requests if r.ttft_ms is not None), key=lambda r: -r.ttft_ms
    )[:SLOWEST_SPANS]
    rows = [
        (
            r.request_id,
            r.ttft_ms,
            r.before_ms,
            r.inside_ms,
            r.queue_ms,
            r.prefill_ms,
            r.after_ms,
            r.inside_or_after_ms,
            r.end_ms,
            ", ".join(f"{c.name} {c.end_ms - c.start_ms:.1f}" for c in r.children[:6]),
        )
        for r in slowest
    ]
    return section(
        "Server spans",
        head,
        table(("part of TTFT", "requests", "mean", "p50", "p90", "p99", "max"), parts),
        section(
            f"The {len(rows)} slowest requests to first token (ms from the send)",
            table(
                (
                    "request",
                    "TTFT",
                    "before",
                    "inside",
                    "queue",
                    "prefill",
                    "after",
                    "inside or after",
                    "span end",
                    "child spans (ms)",
                ),
                rows,
            ),
            level=3,
        ),
    )


def _share(d: dict | None, name: str) -> Raw:
    v = (d or {}).get(name)
    return Raw(f"{v:.1%}" if finite(v) else "—")


def _integrity(result: BenchResult) -> str:
    if not result.requests:
        return ""
    checks = counted_checks(result.workload)
    parts = []
    if not checks:
        parts.append(
            note(
                "Integrity not checked: the output's positions are unknown "
                "(bench with --index-field)."
            )
        )
    parts.append(
        table(
            ("check (must be 0)", "count"),
            ((n, getattr(result.integrity, n)) for n in CHECKS if n in checks),
            bad=lambda i, v: i == 1 and v != 0,
        )
    )
    if checks and "short_streams" not in checks:
        parts.append(
            note("short_streams not counted: the protocol does not say why a stream ended.")
        )
    errors = result.errors_by_code
    if errors:
        first = result.first_error_by_code
        parts.append(
            table(
                ("error code", "requests", "first message"),
                (
                    (code, n, first.get(code, ""))
                    for code, n in sorted(errors.items(), key=lambda kv: -kv[1])
                ),
                bad=lambda i, v: i == 1,
            )
        )
    else:
        parts.append('<p class="ok">No request failed.</p>')
    return section("Integrity and errors", *parts)


def _client(result: BenchResult) -> str:
    if not result.requests:
        return ""
    c = result.client
    share = c.busiest_process_cpu_share
    rows = [
        ("load processes", c.processes),
        ("CPU (s)", c.cpu_s),
        ("CPU per chunk (µs)", c.cpu_per_chunk_us),
        ("busiest process, share of a core", Raw(f"{share:.0%}") if finite(share) else None),
        ("schedule slips", c.schedule_slips),
    ]
    for name, label in (
        ("offered_rate_per_s", "offered rate (requests/s)"),
        ("achieved_rate_per_s", "achieved rate (requests/s)"),
        ("schedule_lag_ms", "schedule error: actual − scheduled send (ms)"),
        ("behind_schedule", "behind its schedule"),
    ):
        value = getattr(c, name)
        if value is not msgspec.UNSET:  # a result from before the client's schedule was kept
            rows.append(
                (label, _distribution_cell(value) if isinstance(value, Distribution) else value)
            )
    return section("Client", table(("", "value"), rows))


def _distribution_cell(d: Distribution) -> Raw:
    """A distribution in one cell: its p50, p99, p99.9 (when known) and max."""
    deep = f", p99.9 {fmt(d.p999)}" if d.p999 and finite(d.p999) else ""
    return Raw(f"p50 {fmt(d.p50)}, p99 {fmt(d.p99)}{deep}, max {fmt(d.max)}")


def _turns(result: BenchResult) -> str:
    parts = []
    if result.ttft_by_turn_ms:
        parts.append(
            section(
                "TTFT by conversation turn",
                table(
                    ("turn", "requests", "mean (ms)", "p50 (ms)", "p99 (ms)", "max (ms)"),
                    [
                        (turn, d.count, d.mean, d.p50, d.p99, d.max)
                        for turn, d in result.ttft_by_turn_ms.items()
                    ],
                ),
                note(
                    "Each turn sends the conversation so far: its prompt grows by a turn each time, "
                    "and repeats the previous turn's prompt as its prefix."
                ),
                level=3,
            )
        )
    cached = result.cached_tokens
    if cached:
        parts.append(
            section(
                "Cached prompt tokens (the server's count)",
                table(
                    ("", "value"),
                    [
                        ("requests reported", cached.requests),
                        ("per request", _distribution_cell(cached.per_request)),
                        (
                            "share of the prompt tokens sent",
                            Raw(f"{cached.share_of_prompt:.1%}")
                            if finite(cached.share_of_prompt)
                            else None,
                        ),
                    ],
                ),
                level=3,
            )
        )
    scraped = field(result, "scraped")
    if scraped is not None and scraped.prefix_cache:
        parts.append(
            section(
                "Prefix cache hit rate by worker (--scrape)",
                table(
                    ("page", "labels", "prompt tokens looked up", "found in the cache", "hit rate"),
                    [
                        (
                            h.url,
                            label_words(h.labels),
                            h.query_tokens,
                            h.hit_tokens,
                            Raw(f"{h.hit_rate:.1%}") if h.hit_rate is not None else None,
                        )
                        for h in scraped.prefix_cache
                    ],
                ),
                note(
                    "From the server's counters over the run (cadence's cadence_prefix_cache_hits_total "
                    "/ _queries_total by worker, vLLM's vllm:prefix_cache_hits_total / "
                    "_queries_total), in tokens."
                ),
                level=3,
            )
        )
    return section("Conversations and prefixes", *parts) if parts else ""


def _saturation(result: BenchResult) -> str:
    seen = field(result, "saturation")
    if seen is None:
        return ""
    return section(
        "Over-saturation stop",
        note(saturation_line(result) or ""),
        table(
            ("window from (s)", "offered (requests/s)", "achieved (requests/s)", "TTFT p50 (ms)"),
            [tuple(w) for w in seen.windows],
        ),
        note(
            "Each window judged by the requests that ended in it: saturated when the achieved "
            "rate is more than 10% under the offered one while TTFT p50 is over twice the lowest "
            "window's and still growing; two in a row end the run."
        ),
    )


def _ended(group: Any) -> str:
    """How a population's or class's requests ended, by status code."""
    return ", ".join(f"{code} {n}" for code, n in sorted(group.codes.items()))


def _classes(result: BenchResult) -> str:
    if not result.by_class:
        return ""
    return section(
        "By request class",
        table(
            (
                "class",
                "requests",
                "ended",
                "prompt p50 (tokens)",
                "max_tokens p50",
                "TTFT p50 (ms)",
                "TTFT p99 (ms)",
                "ITL p99 (ms)",
                "e2e p99 (ms)",
                "its SLO",
                "good share",
            ),
            [
                (
                    name,
                    p.requests,
                    _ended(p),
                    p.prompt_tokens.p50 if p.prompt_tokens else None,
                    p.max_tokens.p50 if p.max_tokens else None,
                    p.ttft_ms.p50,
                    p.ttft_ms.p99,
                    p.itl_ms.p99,
                    p.e2e_ms.p99,
                    terms_words(p.goodput) if p.goodput else "",
                    Raw(f"{p.goodput.good_share:.0%}") if p.goodput else None,
                )
                for name, p in result.by_class.items()
            ],
        ),
        note(
            "Each class (--mix, --class) with its own lengths; its SLO terms judged on its "
            "requests alone."
        ),
    )


def _populations(result: BenchResult) -> str:
    if not result.by_population:
        return ""
    return section(
        "By client population",
        table(
            (
                "population",
                "requests",
                "ended",
                "TTFT p50 (ms)",
                "TTFT p99 (ms)",
                "ITL p50 (ms)",
                "ITL p99 (ms)",
                "e2e p99 (ms)",
            ),
            [
                (
                    name,
                    p.requests,
                    _ended(p),
                    p.ttft_ms.p50,
                    p.ttft_ms.p99,
                    p.itl_ms.p50,
                    p.itl_ms.p99,
                    p.e2e_ms.p99,
                )
                for name, p in result.by_population.items()
            ],
        ),
        note(
            "TTFT over the requests that got a first chunk (cancelled ones too); ITL and e2e over "
            "those that ended OK. Requests the client cancelled on purpose are not errors."
        ),
    )


def _workers(result: BenchResult) -> str:
    rows = [
        (
            w.worker,
            w.device or "",
            w.role or "",
            w.steps,
            w.step_ms_p50,
            w.step_ms_p90,
            w.sequences_per_step_p50,
            w.tokens_per_s,
            w.token_share,
            w.itl_ms_p50,
            None if w.busy_share is msgspec.UNSET else w.busy_share,
            None if w.queue_ms_p50 is msgspec.UNSET else w.queue_ms_p50,
        )
        for w in result.workers or []
    ]
    return section(
        "Workers",
        table(
            (
                "worker",
                "device",
                "role",
                "steps",
                "step p50 (ms)",
                "step p90 (ms)",
                "sequences per step",
                "tokens/s",
                "share of tokens",
                "its streams' ITL p50 (ms)",
                "busy (share of the run)",
                "first outputs' wait p50 (ms)",
            ),
            rows,
        ),
    )


def _system(result: BenchResult) -> str:
    system: System = result.system
    parts = []
    loop = result.front_loop
    if loop is not None and loop.samples:
        parts.append(
            table(
                ("front event loop (timed streams)", "value"),
                (
                    ("timer wake-ups", loop.samples),
                    ("more than 20 ms late", loop.late_over_20ms),
                    ("lag p99 at most (ms)", loop.p99_ms_at_most),
                    ("lag max at most (ms)", loop.max_ms_at_most),
                ),
            )
        )
    parts += [f'<div class="finding">{esc(flag)}</div>' for flag in system.flags]
    rows: list[tuple[str, int | None, float | None, float | None, int | None]] = [
        (name, p.pid, p.cpu_pct_mean, p.cpu_pct_max, len(p.samples))
        for name, p in system.processes.items()
    ]
    host = system.host or None
    if host is not None:
        rows += [(f"other: {o.name}", o.pid, o.cpu_pct, None, None) for o in host.others]
        rows.append(
            (
                f"the host ({host.cpus} cores)",
                None,
                host.busy_pct_mean,
                max((busy for _, busy, _ in host.samples), default=None),
                len(host.samples),
            )
        )
    cpu = table(
        ("process", "pid", "CPU % mean", "CPU % max", "samples"),
        rows,
        bad=lambda i, v: i in (2, 3) and finite(v) and v >= 90,
    )
    parts += [
        cpu,
        note(f"100 % is one core busy; sampled every {system.interval_s:g} s.") if cpu else "",
    ]
    cards = table(
        ("card", "utilisation % mean", "utilisation % max", "memory used max (MiB)", "samples"),
        [
            (g.index, g.util_pct_mean, g.util_pct_max, g.mem_used_mb_max, len(g.samples))
            for g in system.gpus
        ],
    )
    parts.append(section("Cards", cards, level=3))
    if system.server_metrics is not None:
        parts += [_server_metrics(system.server_metrics), _startup(system.server_metrics)]
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


def _server_metrics(scraped: ServerMetrics) -> str:
    """The scraped /metrics: peaks of the gauges, counters' growth over the run."""
    rows = []
    for label, part, name in _SERVER_METRICS:
        value = getattr(scraped, part).get(name)
        if value is not None:  # older results lack the newer metrics
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # counts, shown as counts
            rows.append((label, "peak" if part == "peaks" else "during the run", value))
    loop = scraped.front_loop
    if loop is not None and loop.samples:
        rows.append(
            (
                "front event loop late > 20 ms (samples)",
                "during the run",
                f"{loop.late_over_20ms:.0f} of {loop.samples:.0f}",
            )
        )
    metrics = table(("metric", "", "value"), rows)
    return section(
        "Server metrics",
        metrics,
        note(
            f"{scraped.scrapes} scrapes of {scraped.url}; peaks are of the scrapes, not of every "
            "moment."
        )
        if metrics
        else "",
        level=3,
    )


def _startup(scraped: ServerMetrics) -> str:
    """A start-up row per worker: model load, warm-up, the cold first step against a warm one
    (ms), and restarts; empty for a server that exported none (or an older result)."""
    rows = []
    for w in worker_startup(msgspec.to_builtins(scraped)):
        if w["load_s"] is None:
            continue  # restarts only: nothing measured of this worker's start
        ms = [
            None if w[k] is None else w[k] * 1e3
            for k in ("load_s", "warmup_s", "first_step_s", "warm_step_s")
        ]
        restarts = None if w["restarts"] is None else int(w["restarts"])
        during = None if w["restarts_during_run"] is None else int(w["restarts_during_run"])
        rows.append((f"worker {w['worker']}", *ms, restarts, during))
    startup = table(
        (
            "start-up",
            "load (ms)",
            "warm-up (ms)",
            "first step (ms)",
            "warm step (ms)",
            "restarts",
            "during the run",
        ),
        rows,
        bad=lambda i, v: i == 6 and isinstance(v, int) and v > 0,
    )
    return section(
        "Worker start-up",
        startup,
        note(
            "Before the run, so in none of the latencies above: the last start of each worker (a "
            "restarted worker shows its new start). The server turns SERVING after the warm-up."
        )
        if startup
        else "",
        level=3,
    )


def _read_no_more(endpoint) -> str:
    """Why a page stopped being read during the run (a bound hit); "" when it was read to
    the end."""
    stopped = getattr(endpoint, "stopped", None)
    if not stopped:
        return ""
    if stopped == endpoint.first_error:
        return "; then read no more"
    return f"; read no more: {stopped}"


def _scraped(result: BenchResult, out_dir: Path) -> str:
    """`--scrape`: each page read, the roles over the run, and their plot beside the run's
    latency; "" without `--scrape`."""
    scraped = field(result, "scraped")
    if scraped is None:
        return ""
    pages = table(
        ("page", "server", "scrapes", "failed", "series", "left out"),
        [
            (
                e.url,
                e.server or "none known",
                e.scrapes,
                f"{e.failed_scrapes}"
                + (f" ({e.first_error})" if e.first_error else "")
                + _read_no_more(e),
                e.series,
                f"{e.dropped_series}" + (f" ({', '.join(e.dropped)})" if e.dropped else ""),
            )
            for e in scraped.endpoints
        ],
        bad=lambda column, cell: column == 3 and cell != "0",
    )
    roles = table(
        ("role", "read from", "peak over the run", "mean over the run"),
        [
            (
                ROLE_WORDS.get(name, (name, ""))[0],
                Raw(f"<code>{esc(r.metric)}</code>"),
                role_value(name, r.peak),
                role_value(name, r.mean),
            )
            for name, r in scraped.roles.items()
        ],
    )
    path = plots.plot_scraped(result, out_dir / "server_metrics.png")
    return section(
        "The server's own metrics (--scrape)",
        pages,
        roles,
        note(
            f"Read every {scraped.interval_s:g} s; gauges as read, counters as rates per "
            "second, histograms as the rate of their count and the mean of each interval "
            f"(every series in the JSON's scraped.series, {len(scraped.series)} here). "
            "Roles come from names vLLM, SGLang, Triton, TensorRT-LLM and cadence export."
            + ("" if scraped.roles else " No page had any of them.")
        ),
        figure(
            path,
            "The run's TTFT (each request at its send) and ITL (each chunk at its "
            "arrival) above the server's own metrics, on one time axis.",
        ),
    )


def _verdict(result: BenchResult, out_dir: Path) -> str:
    """What leads the page: the verdict, each tail against its bound and what explains it,
    and the key figures against the SLO when there is one."""
    if not result.requests:
        return ""
    verdict = run_verdict(result)
    tails = [
        (
            TAIL_WORDS[t.metric],
            t.p50_ms,
            t.value_ms,
            t.bound_ms,
            t.bound,
            t.state.replace("_", " "),
            ", ".join(cause_words(t)) or "—",
            Raw(f"{t.unexplained_share:.0%}") if t.unexplained_share is not None else "—",
        )
        for t in verdict.tails
    ]
    goodput = field(result, "goodput")
    slo = goodput.terms if goodput else {}
    ttft, itl = result.ttft_ms, result.itl_ms
    figures: list[tuple[str, float | str | None, float | str, str]] = [
        (
            name,
            value,
            slo[name].bound_ms if name in slo else "—",
            ("met" if slo[name].met else "NOT met") if name in slo else "—",
        )
        for name, value in (
            ("ttft_p50_ms", ttft.p50),
            ("ttft_p99_ms", ttft.p99),
            ("itl_p50_ms", itl.p50),
            ("itl_p99_ms", itl.p99),
        )
    ]
    figures += [
        (name, t.measured_ms, t.bound_ms, "met" if t.met else "NOT met")
        for name, t in slo.items()
        if name not in {row[0] for row in figures}
    ]
    figures += [
        ("tokens/s", result.tokens_per_s, "—", "—"),
        ("requests OK", f"{result.requests_ok} of {result.requests}", "—", "—"),
    ]
    return section(
        "Verdict",
        f'<p class="verdict {esc(verdict.state)}">{esc(verdict.line)}</p>',
        table(
            (
                "tail",
                "p50 (ms)",
                "p99 (ms)",
                "healthy at most (ms)",
                "bound",
                "state",
                "explained by (share of the tail)",
                "unexplained",
            ),
            tails,
            bad=lambda column, cell: column == 5 and cell == "bad",
        ),
        figure(
            plots.plot_attribution(verdict.tails, out_dir / "attribution.png"),
            "Each bad tail's time by cause: the share each finding explains, and in red "
            "what none explains (unexplained_tail).",
        ),
        table(
            ("key figure", "the run's value", "SLO bound", "SLO"),
            figures,
            bad=lambda column, cell: column == 3 and cell == "NOT met",
        ),
        note(f"Healthy: {HEALTHY} (docs/lab.md, The verdict)."),
    )


def _dependence(result: BenchResult, out_dir: Path) -> str:
    """What the latency depends on most, drawn from what the analysis stored."""
    curves = result.dependence or []
    if not curves:
        return ""
    rows = [
        (
            "gaps" if c.latency == "gap" else "first outputs",
            c.variable,
            c.shape or "not significant",
            c.size or "—",
            f"{c.tail_share:.0%}" if c.named else "not named",
        )
        for c in curves
    ]
    return section(
        "What the latency depends on",
        table(("latency", "variable", "shape", "size", "share of the tail"), rows),
        figure(
            plots.plot_dependence(curves, out_dir / "dependence.png"),
            "Each latency's median (line) and quartiles (band) by bin of the variable it "
            "depends on most; by position within the period for a period, by group for a "
            "group (docs/lab.md, What the latency depends on).",
        ),
    )


def _diagnosis(result: BenchResult) -> str:
    if not result.requests:
        return ""
    if not result.diagnosis:
        return '<h2>Diagnosis</h2><p class="ok">No rule fired.</p>'
    parts = []
    for f in result.diagnosis:
        details = "".join(
            f"<dt>{esc(label)}</dt><dd>{_evidence(value)}</dd>"
            for label, value in (("evidence", f.evidence), ("look at", f.look_at))
            if value
        )
        kind = "" if f.alarm else f" ({esc(f.severity)})"
        parts.append(
            f'<div class="finding"><div><span class="rule">{esc(f.rule)}</span>{kind}: '
            f"{esc(f.finding)}</div><dl>{details}</dl></div>"
        )
    return section("Diagnosis", *parts)


def _evidence(value: Any) -> str:
    """A finding's evidence: text as it is, a dict of numbers as `name value` pairs."""
    if isinstance(value, dict):
        return ", ".join(f"{esc(k)} <b>{fmt(v)}</b>" for k, v in value.items())
    return esc(value)


def _baseline(result: BenchResult) -> str:
    baseline: EngineOnly | None = field(result, "baseline")
    if baseline is None:
        return ""
    title = "Against the engine-only baseline"
    if baseline.error:
        return section(title, note(f"No baseline: {baseline.error}"))
    rows = []
    for n in aggregate_names(baseline):
        run, base = getattr(result, n), getattr(baseline, n)
        row: list[Any] = [n]
        for stat in ("p50", "p99"):
            r, b = getattr(run, stat), getattr(base, stat)
            row += [r, b, overhead_cell(r - b)]
        rows.append(row)
    extra = [
        (label, getattr(result, key), b)
        for key, label in THROUGHPUT
        if finite(b := getattr(baseline, key)) and b
    ]
    rows_overhead = [
        (m, *(overhead_cell(getattr(d, s)) for s in STATS))
        for m, d in (field(result, "overhead_ms") or {}).items()
    ]
    return section(
        title,
        table(
            ("metric", "run p50", "baseline p50", "Δ p50", "run p99", "baseline p99", "Δ p99"), rows
        ),
        table(("", "run", "baseline"), extra),
        section(
            "Serving overhead (served − engine-only, ms)",
            table(("metric", *STATS), rows_overhead),
            note(
                "An overhead below zero is the noise of two runs, not a gain: shown as "
                "within noise."
            )
            if rows_overhead
            else "",
            level=3,
        ),
    )


def overhead_cell(value: Any) -> Raw:
    return Raw(esc(overhead(value)))


# -- plots ----------------------------------------------------------------------------------


def _plots(result: BenchResult, out_dir: Path, records_note: str) -> str:
    """The plots of one run besides the segments'."""
    records = field(result, "records") or []
    if not records and not records_note and result.ttft_ms.count:
        records_note = "No raw records in this result: no CDF or ITL-over-time plots."
    jobs = [
        (
            "ttft_cdf.png",
            lambda p: plots.plot_ttft_cdf(records, p),
            "TTFT CDF over OK requests; dotted/dashed lines at p50, p90, p99.",
        ),
        (
            "itl_cdf.png",
            lambda p: plots.plot_itl_cdf(records, p),
            "ITL CDF: one value per chunk after the first, its gap over its tokens.",
        ),
        (
            "itl_over_time.png",
            lambda p: plots.plot_itl_over_time(records, p),
            (
                "Per-chunk ITL of 5 streams (the one with the worst ITL and 4 spread over the run) "
                "against time since the first request was sent."
            ),
        ),
        (
            "workers.png",
            lambda p: plots.plot_worker_curves(result.workers, p),
            (
                "Each worker's output curve over the run: step time, this run's sequences per "
                "step, tokens per second (0.25 s windows)."
            ),
        ),
        (
            "cpu.png",
            lambda p: plots.plot_cpu(result.system, p),
            (
                "CPU % per process over the run (100 % = one core), and card utilisation when "
                "cards were sampled."
            ),
        ),
    ]
    return section(
        "Plots",
        note(records_note) if records_note else "",
        *(figure(draw(out_dir / name), caption) for name, draw, caption in jobs),
    )


def _segment_figure(result: BenchResult, out_dir: Path) -> str:
    path = plots.plot_segments(plots.segment_stacks(result), out_dir / "segments.png")
    return figure(
        path,
        "Segment means, stacked: a request's TTFT, and a chunk's path from its "
        "step's start to the client, each on its own axis.",
    )


# -- the report -----------------------------------------------------------------------------


def _run_sections(result: BenchResult, out_dir: Path, records_note: str) -> list[str]:
    return [
        _aborted(result),
        _verdict(result, out_dir),
        _diagnosis(result),
        _dependence(result, out_dir),
        _goodput(result),
        _run(result),
        _workload(result),
        _throughput(result),
        _aggregates(result),
        _turns(result),
        _populations(result),
        _classes(result),
        _saturation(result),
        _segments(result, _segment_figure(result, out_dir)),
        _server_spans(result),
        _integrity(result),
        _client(result),
        _http2(result),
        _server_threads(result),
        _workers(result),
        _system(result),
        _scraped(result, out_dir),
        _baseline(result),
        _plots(result, out_dir, records_note),
    ]


def render_report(
    result: BenchResult | SweepResult | dict,
    out_dir: Path,
    title: str | None = None,
    source: str = "",
    records_note: str = "",
) -> Path:
    """Write the plots and `report.html` for `result` (typed, or as read from JSON) into
    `out_dir`; return the HTML's path. The title says what was measured (the target, or what
    the sweep varied) unless given; `source` names the file read, under it; `records_note`
    says why the records could not be read (`decode_result`)."""
    if isinstance(result, dict):
        result, records_note = decode_result(result)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(result, SweepResult):
        first = sweep.first_repeat(result.sweep)
        title = title or sweep.title(result.sweep)
        parts = [
            _workload(first, "Workload (of the sweep's first run)"),
            _run(first, "Run (the sweep's first)"),
            sweep.sweep_section(result.sweep, out_dir),
        ]
    else:
        target = result.workload.target
        title = title or (f"cadence bench: {target}" if target else "cadence report")
        parts = _run_sections(result, out_dir, records_note)
    if not any(parts):
        parts.append(note("This result holds nothing the report knows how to show."))
    path = out_dir / REPORT_NAME
    path.write_text(page(title, f"from {source}" if source else "", parts), encoding="utf-8")
    return path
