"""The terminal summary of a bench run (rich). It leads with what a reader needs first: the
verdict, the key figures against any SLO, and the findings; then the aggregates, client,
workers, system and integrity, one line or table each."""

from __future__ import annotations

import math
import sys

import msgspec
from msgspec import UNSET

from cadence.lab.analysis.diagnosis import CLIENT_BUSY_SHARE
from cadence.lab.analysis.diagnosis.facts import finite
from cadence.lab.analysis.goodput import terms_words
from cadence.lab.analysis.integrity import CHECK_WORDS, counted_checks
from cadence.lab.analysis.startup import worker_startup
from cadence.lab.analysis.verdict import judge
from cadence.lab.records import MAX_KEPT_BYTES, MAX_SPANS
from cadence.lab.results import (
    BenchResult,
    Client,
    Distribution,
    Finding,
    Goodput,
    Http2Settings,
    RunInfo,
    ScrapedFrontLoop,
    ScrapedMetrics,
    ServerSpans,
    ServerThreads,
    System,
    Verdict,
    WorkerCurve,
)
from cadence.wording import counted

PIPED_WIDTH = 10_000
"""Piped output is read by scripts and pasted: no line is wrapped (a number split across two
lines reads as two numbers)."""
WITHIN_NOISE = "within noise"
"""How a negative overhead reads: served faster than the engine alone is run-to-run noise."""
_COLUMNS = ("mean", "p50", "p90", "p99", "p999", "max")
_HEADINGS = {"p999": "p99.9"}
_ROWS = (
    "ttft_ms",
    "ttft_from_schedule_ms",
    "connect_ms",
    "ttft_after_connect_ms",
    "itl_ms",
    "chunk_gap_ms",
    "tpot_ms",
    "e2e_ms",
    "e2e_from_schedule_ms",
    "token_delay_ms",
    "chunk_tokens",
)
"""connect_ms and ttft_after_connect_ms: HTTP runs only (TTFT apart from the connect); the
*_from_schedule_ms: open loops only (counted from the scheduled send)."""


def print_summary(result: BenchResult) -> None:
    """A table of the aggregates (rich)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    piped = not sys.stdout.isatty()
    console = Console(soft_wrap=piped, width=PIPED_WIDTH if piped else None)
    workload = result.workload
    title = f"cadence bench: {workload.target}"
    if workload.protocol == "kserve":
        title += f" (Open Inference Protocol, model {workload.model})"
    elif workload.openai:
        title += f" (OpenAI {workload.openai.endpoint}, model {workload.model})"
    elif workload.grpc:
        title += f" ({workload.grpc.method}, types from {workload.grpc.types_from})"
    console.print(f"[bold]{escape(title)}[/]", highlight=False)
    _print_verdict(console, result)
    _print_diagnosis(console, result.diagnosis)
    table = Table(title="the run's figures", show_lines=False)
    table.add_column("metric")
    for col in _COLUMNS:
        table.add_column(_HEADINGS.get(col, col), justify="right")
    for name in _ROWS:
        d: Distribution | None = getattr(result, name) or None
        if d is not None and d.count:  # no row of nan when no request gave a value
            table.add_row(name, *_cells(d))
    if result.segments_ms:
        for name, d in msgspec.structs.asdict(result.segments_ms).items():
            table.add_row(f"  segment {name}", *_cells(d))
    if result.handoff_segments_ms:  # disaggregated serving
        handoff = result.handoff_segments_ms
        for name in ("export", "to_decode"):
            d = getattr(handoff, name)
            if d.count:
                table.add_row(f"  hand-off {name}", *_cells(d))
    console.print(table)
    for line in (
        reasoning_line(result),
        turns_line(result),
        cached_line(result),
        prefix_cache_line(result),
        handoff_line(result),
        *population_lines(result),
        *repeats_lines(result),
    ):
        if line:
            console.print(line, highlight=False, markup=False)
    if result.overhead_ms:
        o = result.overhead_ms
        console.print(
            "serving overhead (served − engine-only, ms): "
            + ", ".join(f"{m} p50 {overhead(o[m].p50)} p99 {overhead(o[m].p99)}" for m in o)
        )
    elif result.baseline and result.baseline.error:
        console.print(f"baseline: {result.baseline.error}")
    client = result.client
    per_chunk, busiest = client.cpu_per_chunk_us, client.busiest_process_cpu_share or 0.0
    console.print(
        f"client: {client.processes} process(es), "
        + (f"{per_chunk:.0f} µs CPU per chunk, " if per_chunk is not None else "no chunks, ")
        + f"busiest process {busiest:.0%} of a core"
        + (
            " (the client may be the bottleneck: add --procs)"
            if busiest >= CLIENT_BUSY_SHARE
            else ""
        )
    )
    schedule = schedule_line(client)
    if schedule:
        console.print(schedule, highlight=False)
    saturation = saturation_line(result)
    if saturation:
        console.print(saturation, highlight=False, markup=False)
    if result.http2:
        console.print(http2_line(result.http2), highlight=False, markup=False)
    if result.server_threads:
        # py-spy samples any server but cadence's own, whose timing says more (bench.py).
        sampled = result.workload.protocol != "cadence"
        for line in thread_lines(result.server_threads, stacks_sampled=sampled):
            console.print(line, highlight=False, markup=False)
    for line in worker_lines(result.workers or []):
        console.print(line, highlight=False)
    _print_system(console, result.system)
    for line in scraped_lines(result.scraped or None):
        console.print(line, highlight=False, markup=False)
    loop = result.front_loop
    if loop and loop.samples:
        console.print(
            f"front event loop (from the timed streams): {loop.late_over_20ms:.0f} of "
            f"{loop.samples:.0f} timer wake-ups more than 20 ms late, p99 <= "
            f"{loop.p99_ms_at_most:g} ms, max <= {loop.max_ms_at_most:g} ms"
        )
    integrity = result.integrity
    console.print(
        f"requests {result.requests_ok}/{result.requests} ok, errors "
        f"{result.errors_by_code or 'none'}; {result.output_tokens} tokens in {result.chunks} "
        f"chunks over {result.wall_s:.2f} s: {result.tokens_per_s:.0f} tokens/s, "
        f"{result.chunks_per_s:.0f} chunks/s, {result.requests_per_s:.1f} requests/s"
        + (
            f"; {result.cancelled_by_client} cancelled by the client on purpose (not errors)"
            if result.cancelled_by_client
            else ""
        )
    )
    for code, message in result.first_error_by_code.items():
        console.print(f"  {code}: {message}", highlight=False)
    checks = counted_checks(workload)
    if not checks:
        console.print(
            "integrity: not checked (the output's positions are unknown: give --index-field)"
        )
    else:
        console.print(
            "integrity: "
            + ", ".join(f"{CHECK_WORDS[name]} {getattr(integrity, name)}" for name in checks)
            + (
                f" (information: usage counts {integrity.usage_above_events} outputs more than "
                f"the text events in {integrity.usage_above_events_streams} streams)"
                if integrity.usage_above_events_streams
                else ""
            )
        )
    if result.server_spans:
        console.print(spans_line(result.server_spans), highlight=False, markup=False)
    if result.run:
        console.print(run_line(result.run), highlight=False, markup=False)


_STATE_STYLE = {"healthy": "bold green", "unhealthy": "bold red", "inconclusive": "bold yellow"}


def _cells(d: Distribution) -> list[str]:
    """A table row's figures; "-" for one the result does not hold (p99.9 of an older run)."""
    return [f"{v:.2f}" if (v := getattr(d, c)) is not UNSET else "-" for c in _COLUMNS]


def _print_verdict(console, result: BenchResult) -> None:
    """What leads the summary: the verdict, the key figures against any SLO, whether the run
    stopped early."""
    from rich.markup import escape

    verdict = run_verdict(result)
    console.print(
        f"[{_STATE_STYLE[verdict.state]}]verdict {escape(verdict.line)}[/]", highlight=False
    )
    console.print(key_figures(result), highlight=False, markup=False)
    if result.goodput:
        console.print(goodput_line(result.goodput), highlight=False, markup=False)
    if result.aborted:
        console.print(f"[bold red]run {escape(result.aborted)}[/]", highlight=False)


def run_verdict(result: BenchResult) -> Verdict:
    """The run's verdict: as it was written, or judged now for a result written before
    verdicts (without the findings that judging would add)."""
    return result.verdict or judge(result)[0]


def key_figures(result: BenchResult) -> str:
    """The figures a reader looks at first, in one line."""
    ttft, itl = result.ttft_ms, result.itl_ms
    failed = result.requests - result.requests_ok - (result.cancelled_by_client or 0)
    return (
        f"TTFT p50 {ttft.p50:.1f} / p99 {ttft.p99:.1f} ms, ITL p50 {itl.p50:.1f} / p99 "
        f"{itl.p99:.1f} ms, {result.tokens_per_s:,.0f} tokens/s, "
        f"{result.requests_ok}/{result.requests} requests ok"
        + (f" ({failed} failed)" if failed else "")
    )


def schedule_line(client: Client) -> str | None:
    """The open loop's rates and schedule lag, and whether the client fell behind; None in a
    closed loop (or for a result saved before these were measured)."""
    if client.offered_rate_per_s is None or client.offered_rate_per_s is UNSET:
        return None
    achieved, lag = client.achieved_rate_per_s, client.schedule_lag_ms
    line = f"open loop: offered {client.offered_rate_per_s:g} requests/s, achieved " + (
        f"{achieved:.1f}" if isinstance(achieved, float | int) else "?"
    )
    if lag:
        line += (
            f"; schedule error (actual − scheduled send) p50 {lag.p50:.2f} ms, p99 "
            f"{lag.p99:.2f} ms" + (f", p99.9 {lag.p999:.2f} ms" if lag.p999 else "")
        )
    if client.behind_schedule:
        line += (
            " [bold red]: the client fell behind its schedule (the server saw a lower load "
            "than offered; add --procs)[/]"
        )
    return line


def saturation_line(result: BenchResult) -> str | None:
    """What the over-saturation stop saw; None without it."""
    seen = result.saturation
    if not seen:
        return None
    peak = seen.peak_achieved_rate_per_s or 0.0
    if seen.stopped:
        return (
            f"over-saturation stop: the server stopped keeping up at {seen.knee_rate_per_s:.1f}"
            f" requests/s offered ({seen.knee_at_s:.1f} s in); the run ended at "
            f"{seen.stopped_at_s:.1f} s; at most {peak:.1f} requests/s ended in a "
            f"{seen.window_s:g} s window"
        )
    return (
        f"over-saturation stop: no knee within the load offered (at most {peak:.1f} "
        f"requests/s ended in a {seen.window_s:g} s window)"
    )


def turns_line(result: BenchResult) -> str | None:
    """TTFT by conversation turn, in one line; None without turns."""
    if not result.ttft_by_turn_ms:
        return None
    return "TTFT by turn (p50 / p99 ms): " + ", ".join(
        f"turn {turn} {d.p50:.1f} / {d.p99:.1f} (n={d.count})"
        for turn, d in result.ttft_by_turn_ms.items()
    )


def population_lines(result: BenchResult) -> list[str]:
    """Each client population's and request class's requests and figures, one line each;
    [] without them."""
    lines = []
    for title, groups in (
        ("by client population:", result.by_population),
        ("by request class:", result.by_class),
    ):
        if not groups:
            continue
        lines.append(title)
        for name, p in groups.items():
            codes = ", ".join(f"{code} {n}" for code, n in sorted(p.codes.items()))
            line = (
                f"  {name}: {p.requests} requests ({codes}); TTFT p50 {p.ttft_ms.p50:.1f}"
                f" / p99 {p.ttft_ms.p99:.1f} ms, ITL p50 {p.itl_ms.p50:.1f} / p99 "
                f"{p.itl_ms.p99:.1f} ms, e2e p99 {p.e2e_ms.p99:.1f} ms"
            )
            if p.goodput:
                line += f"; SLO {terms_words(p.goodput)}; good {p.goodput.good_share:.0%}"
            lines.append(line)
    return lines


def repeats_lines(result: BenchResult) -> list[str]:
    """Each repeated figure's mean and 95% confidence interval (`--repeat`); [] for one run."""
    if not result.repeats:
        return []
    lines = [
        (
            f"over {result.repeats.runs} runs (mean, 95% confidence interval of the mean; "
            "the table above is the first run's):"
        )
    ]
    for name, f in result.repeats.figures.items():
        if not math.isnan(f.mean):
            lines.append(
                f"  {name} {f.mean:,.2f} ({f.ci95_low:,.2f} to {f.ci95_high:,.2f}); "
                "runs " + ", ".join(f"{v:,.2f}" for v in f.values)
            )
    return lines


def handoff_line(result: BenchResult) -> str:
    """Disaggregated serving: how many requests moved, from which workers to which."""
    handoff = result.handoff_segments_ms
    if not handoff:
        return ""
    return (
        f"handed off: {handoff.requests} requests from prefill worker(s) "
        f"{_by_worker(handoff.by_prefill_worker)} to decode worker(s) "
        f"{_by_worker(handoff.by_decode_worker)}"
    )


def _by_worker(counts: dict[str, int]) -> str:
    return ", ".join(f"{w} ({n})" for w, n in sorted(counts.items()))


def cached_line(result: BenchResult) -> str | None:
    """The prompt tokens the server said it had cached; None when it said nothing."""
    cached = result.cached_tokens
    if not cached:
        return None
    return (
        f"cached prompt tokens (the server's count, {cached.requests} requests): p50 "
        f"{cached.per_request.p50:.0f}, max {cached.per_request.max:.0f} per request, "
        f"{cached.share_of_prompt:.0%} of the prompt tokens sent"
    )


def prefix_cache_line(result: BenchResult) -> str | None:
    """The prefix cache's hit rate by worker, from the scraped counters; None without them."""
    scraped = result.scraped
    hits = scraped.prefix_cache if scraped else None
    if not hits:
        return None
    return "prefix cache hit rate (--scrape, of the prompt tokens looked up): " + "; ".join(
        f"{label_words(h.labels)} "
        + (
            f"{h.hit_rate:.0%} of {h.query_tokens:,.0f}"
            if h.hit_rate is not None
            else "none looked up"
        )
        for h in hits
    )


def reasoning_line(result: BenchResult) -> str | None:
    """TTFT of the first reasoning output and of the first answer; None without reasoning."""
    thought, answer = result.ttft_reasoning_ms, result.ttft_answer_ms
    if not thought:
        return None
    line = (
        f"reasoning streamed apart ({thought.count} requests): first reasoning output p50 "
        f"{thought.p50:.1f} / p99 {thought.p99:.1f} ms"
    )
    if answer and answer.count:
        line += f", first answer output p50 {answer.p50:.1f} / p99 {answer.p99:.1f} ms"
    return line


def label_words(labels: dict[str, str]) -> str:
    """`worker 0`, `engine 0 model_name m`: a label set in words."""
    return " ".join(f"{k} {v}" for k, v in sorted(labels.items())) or "all"


_THREAD_GROUPS_SHOWN = 5


def thread_lines(threads: ServerThreads, stacks_sampled: bool = True) -> list[str]:
    """The server's busiest thread groups over the run, and what py-spy would add where the
    bench samples the server's stacks (`stacks_sampled`) and its host had no py-spy (as the
    result records it: the host rendering the report is not the one that ran the bench)."""
    busy = [g for g in threads.groups if g.cpu_pct >= 1.0 or g.wait_for_cpu_pct >= 1.0]
    lines = [
        f"server threads ({threads.threads} in {len(threads.processes)} process(es), "
        f"% of one core): "
        + (
            ", ".join(
                f"{g.name} x{g.threads} {g.cpu_pct:.0f}% (busiest {g.busiest_thread_cpu_pct:.0f}%"
                f", waiting for a CPU {g.wait_for_cpu_pct:.0f}%, "
                f"{g.involuntary_switches_per_s:,.0f} preempted/s)"
                for g in busy[:_THREAD_GROUPS_SHOWN]
            )
            or "all idle"
        )
    ]
    for group in threads.stacks or []:
        spots = "; ".join(
            f"{s.count} in {s.where}" + (f" from {s.code}" if s.code else "") for s in group.spots
        )
        lines.append(f"  {group.name} x{group.threads} (py-spy, {group.samples} samples): {spots}")
    if (
        stacks_sampled
        and threads.stacks is None
        and any(p.python for p in threads.processes)
        and threads.py_spy is False
    ):
        lines.append(
            "  (pip install py-spy: what each Python thread group is doing, sampled "
            "during the run, e.g. how many pool threads wait inside the handler)"
        )
    return lines


def goodput_line(goodput: Goodput) -> str:
    """The run under its SLO: goodput, and each term against the run's percentile."""
    return (
        f"SLO {'passed' if goodput.passed else 'FAILED'} ({terms_words(goodput)}); goodput "
        f"{goodput.requests_per_s:.1f} requests/s, {goodput.tokens_per_s:,.0f} tokens/s, "
        f"{goodput.good_share:.0%} of requests good"
    )


def spans_line(spans: ServerSpans) -> str:
    """The server's spans: how many requests they matched, and TTFT split at their edges
    (means, which add up; p99 of each part after)."""
    head = (
        f"server spans (OTLP on port {spans.port}): {spans.matched}/{spans.sent} requests "
        f"matched ({spans.spans_received} spans"
        + (f" from {', '.join(spans.services)}" if spans.services else "")
        + ")"
    )
    if spans.spans_dropped:
        head += (
            f"; {spans.spans_dropped} more spans dropped, past what the receiver keeps "
            f"({MAX_SPANS:,} spans or {MAX_KEPT_BYTES >> 20} MiB)"
        )
    split = spans.ttft_split_ms
    if not spans.matched:
        return head + (
            "; none of the run's trace ids came back: is the server pointed at "
            "this port (--otlp-traces-endpoint) and does it propagate traceparent?"
        )
    if "before" not in split:
        return head
    mean = {name: d.mean for name, d in split.items()}
    inner = [
        f"{word} {mean[name]:.1f}"
        for name, word in (("queue", "queue"), ("prefill", "prefill"), ("inside_other", "rest"))
        if name in mean
    ]
    if "inside" in mean:
        middle = (
            f"inside it {mean['inside']:.1f}"
            + (f" ({', '.join(inner)})" if inner else "")
            + f" + after it {mean['after']:.1f}"
        )
        tails: tuple[str, ...] = ("before", "inside", "after")
    else:
        middle = (
            "inside it or after (the server does not say when it sent) "
            f"{mean['inside_or_after']:.1f}" + (f" (of which {', '.join(inner)})" if inner else "")
        )
        tails = ("before", "inside_or_after")
    total = sum(mean[name] for name in tails)
    return (
        head + f"; TTFT mean {total:.1f} ms = before the server's span "
        f"{mean['before']:.1f} + {middle}; p99 "
        + ", ".join(f"{name.replace('_', ' ')} {split[name].p99:.1f}" for name in tails)
    )


def http2_line(settings: Http2Settings) -> str:
    """The gRPC server's HTTP/2 settings, as read before the run."""
    if settings.error:
        return f"HTTP/2 settings of the server: not read ({settings.error})"
    limit = settings.max_concurrent_streams
    return (
        "HTTP/2 settings of the server"
        + (" (TLS)" if settings.tls else "")
        + ": "
        + (
            f"at most {limit} streams per connection"
            if limit is not None
            else "no stream limit per connection"
        )
        + f", initial window {_bytes(settings.initial_window_size, 65_535)}, "
        f"max frame {_bytes(settings.max_frame_size, 16_384)}"
    )


def _bytes(value: int | None, default: int) -> str:
    """A setting in bytes; a setting the server left out is HTTP/2's default."""
    return f"{value if value is not None else default:,} B" + (
        " (default)" if value is None else ""
    )


def run_line(run: RunInfo) -> str:
    """When, where and with what the run was made, and the server's command line."""
    import shlex

    server = shlex.join(run.server_cmdline) if run.server_cmdline else "not found here"
    if run.server_process:
        server += f"; port served by {run.server_process}"
    return (
        f"run: {run.started_at} on {run.host} ({run.cpu_count} CPUs), cadence "
        f"{run.cadence_version}, grpcio {run.grpcio_version}, Python "
        f"{run.python_version}; server: {server}"
    )


def overhead(value: float | None) -> str:
    """A serving overhead (ms) as text: a negative one is noise, not a gain."""
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "—"
    return WITHIN_NOISE if value < 0 else f"+{value:.2f}"


def _print_diagnosis(console, findings: list[Finding]) -> None:
    if not findings:
        console.print("diagnosis: no rule fired")
    for f in findings:
        evidence = ", ".join(f"{k} {v}" for k, v in f.evidence.items())
        kind = "" if f.alarm else f" ({f.severity})"
        console.print(
            f"[bold]diagnosis{kind} {f.rule}:[/] {f.finding}\n  evidence: {evidence}"
            f"\n  look at: {f.look_at}",
            highlight=False,
        )


def _print_system(console, system: System) -> None:
    cpu = ", ".join(
        f"{name} {p.cpu_pct_mean:.0f}%"
        for name, p in system.processes.items()
        if p.cpu_pct_mean is not None
    )
    host = system.host or None
    if host is not None and host.busy_pct_mean is not None:
        cpu += (", " if cpu else "") + f"host {host.busy_pct_mean:.0f}% of {100 * host.cpus}"
    if cpu:
        console.print(f"CPU (mean, % of one core): {cpu}")
    for gpu in system.gpus:
        console.print(
            f"card {gpu.index}: {gpu.util_pct_mean:.0f}% utilised (mean), "
            f"{gpu.mem_used_mb_max:.0f} MiB at most"
        )
    scraped = system.server_metrics
    if scraped:
        during, peaks = scraped.during_run, scraped.peaks
        console.print(
            f"server metrics ({scraped.scrapes} scrapes): deepest request buffer "
            f"{peaks.get('cadence_deepest_buffer_steps', 0):.0f} steps, peak active streams "
            f"{peaks.get('cadence_active_streams', 0):.0f}; during the run "
            f"{during.get('cadence_merged_steps_total', 0):.0f} steps merged, "
            f"{during.get('cadence_buffer_overflows_total', 0):.0f} buffer overflows"
            + _blocking(during, peaks)
            + _front_loop(scraped.front_loop)
        )
        for line in startup_lines(worker_startup(msgspec.to_builtins(scraped))):
            console.print(line, highlight=False)
    for flag in system.flags:
        console.print(f"[bold red]{flag}[/]")


ROLE_WORDS = {
    "running": ("requests running", ""),
    "waiting": ("waiting", ""),
    "kv_cache_use": ("KV cache in use", "%"),
    "preempted": ("preempted", "/s"),
}
"""How each role of `--scrape` reads: its words and its unit."""


def role_value(role: str, value: float | None) -> str:
    """A role's value as read: the KV cache as a percentage, the others as numbers."""
    if value is None:
        return "?"
    unit = ROLE_WORDS.get(role, ("", ""))[1]
    if unit == "%":
        return f"{100 * value:.0f}%"
    return f"{value:.1f}{unit}" if unit or not float(value).is_integer() else f"{value:.0f}"


def scraped_lines(scraped: ScrapedMetrics | None) -> list[str]:
    """`--scrape`: a line per page (what it is, how many scrapes and series, what failed or
    was left out), and one of the roles over the run."""
    if scraped is None:
        return []
    lines = []
    for e in scraped.endpoints:
        line = (
            f"scraped {e.url} ({e.server or 'no names of a known server'}): {e.scrapes} "
            f"scrapes, {e.series} series"
        )
        if e.failed_scrapes:
            line += f"; {e.failed_scrapes} failed (first: {e.first_error})"
        if e.stopped:
            line += (
                "; then read no more"
                if e.stopped == e.first_error
                else f"; read no more after: {e.stopped}"
            )
        if e.dropped_series:
            line += (
                f"; {e.dropped_series} series left out (label sets or series over the "
                f"cap: {', '.join(e.dropped)})"
            )
        lines.append(line)
    roles = [
        f"{ROLE_WORDS.get(name, (name, ''))[0]} peak {role_value(name, r.peak)} (mean "
        f"{role_value(name, r.mean)})"
        for name, r in scraped.roles.items()
    ]
    if roles:
        lines.append("the server's own metrics over the run: " + ", ".join(roles))
    return lines


def _front_loop(loop: ScrapedFrontLoop | None) -> str:
    """The front's event-loop lag over the run; empty when the server exported none."""
    if not loop or not loop.samples:
        return ""
    return (
        f"; front event loop late > 20 ms in {loop.late_over_20ms:.0f} of "
        f"{loop.samples:.0f} samples"
    )


def _blocking(during: dict, peaks: dict) -> str:
    """The blocking the run saw (--overflow block): pauses issued, most paused at a scrape.
    Empty for a result saved before the server exported them."""
    if "cadence_sequence_pauses_total" not in during:
        return ""
    return (
        f"; blocking: {during['cadence_sequence_pauses_total']:.0f} sequence pauses, "
        f"{peaks.get('cadence_paused_sequences', 0):.0f} paused at the busiest scrape"
    )


def worker_lines(workers: list[WorkerCurve]) -> list[str]:
    """One line per worker's output curve (lab/analysis/worker_curves.py)."""
    return [
        f"worker {w.worker}"
        + (f" ({w.device})" if w.device else "")
        + (f" {w.role}" if w.role else "")
        + f": step p50 {w.step_ms_p50:.1f} / p90 {w.step_ms_p90:.1f} ms, "
        f"{w.sequences_per_step_p50:.0f} sequences per step, {w.tokens_per_s:,.0f} "
        f"tokens/s ({w.token_share:.0%} of the run's), "
        + (
            f"its streams' ITL p50 {w.itl_ms_p50:.1f} ms"
            if finite(w.itl_ms_p50)
            else "no stream's gaps"  # a prefill worker's: first outputs only
        )
        + (f", busy {w.busy_share:.0%} of its time" if finite(w.busy_share) else "")
        + (
            f", first outputs waited {w.queue_ms_p50:.1f} ms (p50)"
            if w.role and finite(w.queue_ms_p50)
            else ""
        )
        for w in workers
    ]


def startup_lines(startup: list[dict]) -> list[str]:
    """One "start-up" line per worker (from `analysis.startup.worker_startup`): model load, warm-up,
    and the cold first step against a warm one. All before the run, so none of it is in the
    serving latencies above; shown apart so a slow start is not read as slow serving."""
    lines = []
    for w in startup:
        if w["load_s"] is None:
            continue  # restarts only: nothing measured of this worker's start
        line = (
            f"start-up worker {w['worker']}: load {_ms(w['load_s'])}, warm-up "
            f"{_ms(w['warmup_s'])} (first step {_ms(w['first_step_s'])} vs warm step "
            f"{_ms(w['warm_step_s'])})"
        )
        if w["restarts"]:
            line += (
                f"; {counted(int(w['restarts']), 'restart')}, {w['restarts_during_run']:.0f} during "
                "the run (the values are of the last start)"
            )
        lines.append(line)
    return lines


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"
