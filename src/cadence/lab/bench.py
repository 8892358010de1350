"""`cadence bench`: drive a server with a fixed workload and report what the client saw."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from cadence.credentials import ClientCredentials
from cadence.lab.baseline import engine_config_of, run_baseline
from cadence.lab.diagnosis import diagnose
from cadence.lab.grpc_load import GrpcTarget
from cadence.lab.kserve_load import KServeTarget
from cadence.lab.loadgen import ProcessPlan, RequestCounter, RequestShape, run_load
from cadence.lab.openai_load import OpenAITarget
from cadence.lab.sampler import (
    SystemSampler,
    listener_pid,
    metrics_url,
    server_processes,
    worker_devices,
    worker_startup,
)
from cadence.lab.stats import summarize
from cadence.lab.worker_curves import worker_curves


@dataclass(frozen=True)
class Workload:
    """What to send: how many requests, how they arrive, what they look like.

    Closed loop: `concurrency` streams open at once, each starting the next request when
    one ends. Open loop: `rate` requests per second, Poisson arrivals. Bounded by
    `requests`, `duration_s` or both (whichever ends first).
    """

    requests: int | None = None
    concurrency: int = 1
    rate: float | None = None
    duration_s: float | None = None
    shape: RequestShape = field(default_factory=RequestShape)
    include_timing: bool = True
    timeout_s: float | None = None
    warmup: int = 0
    read_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("bound the run: give a number of requests, a duration, or both")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")

    def plans(self, target: str, processes: int, channels: int = 1,
              credentials: ClientCredentials | None = None,
              kserve: KServeTarget | None = None,
              grpc: GrpcTarget | None = None,
              openai: OpenAITarget | None = None) -> list[ProcessPlan]:
        """Split the requests and the concurrency evenly over `processes` client processes.
        With `kserve`, they speak the Open Inference Protocol to that model; with `grpc`,
        they drive that method of any gRPC service."""
        return [
            ProcessPlan(
                process=p,
                processes=processes,
                target=target,
                shape=self.shape,
                requests=self.requests,
                duration_s=self.duration_s,
                concurrency=max(1, len(range(p, self.concurrency, processes))),
                rate=self.rate,
                include_timing=self.include_timing,
                timeout_s=self.timeout_s,
                channels=channels,
                warmup=self.warmup,
                read_delay_ms=self.read_delay_ms,
                credentials=credentials,
                kserve=kserve,
                grpc=grpc,
                openai=openai,
            )
            for p in range(processes)
        ]


def run_bench(target: str, workload: Workload, processes: int = 1, channels: int = 1,
              baseline: bool = False, credentials: ClientCredentials | None = None,
              kserve: KServeTarget | None = None,
              counter: RequestCounter | None = None, grpc: GrpcTarget | None = None,
              server_pid: int | None = None, openai: OpenAITarget | None = None) -> dict:
    """Run `workload` against `target`; return the summary plus the raw records.

    With `baseline`, also replay the workload through the server's engine alone (the server
    must run on this host) and report serving overhead = served − engine-only.
    `credentials` are for a server started with TLS or bearer tokens. With `kserve`, the
    requests go to that model over the Open Inference Protocol (any server of it; no server
    timing, so no segments). With `grpc`, they drive that method of any gRPC service (no
    server timing either). `counter` counts finished requests while the load runs, for a
    progress display (lab/progress.py); it changes nothing in the result. `server_pid` names
    the server process whose CPU to sample (default: cadence's processes, or for `grpc`, the
    process listening on the target's port when it is on this host).
    """
    protocol = ("kserve" if kserve is not None else "grpc" if grpc is not None
                else "openai" if openai is not None else "cadence")
    if openai is not None:  # the OpenAI target is a URL; the server's host:port for the rest
        target = openai.base_url.split("://", 1)[-1].rstrip("/")
    foreign = protocol in ("grpc", "openai")
    """Any server: no cadence metrics endpoint or workers to look up."""
    sampler = SystemSampler(metrics_url=metrics_url(target) if not foreign else None)
    for name, pid in _server_to_sample(target, protocol, server_pid).items():
        sampler.watch(name, pid)
    sampler.start()
    try:
        processes_out = run_load(
            workload.plans(target, processes, channels, credentials, kserve, grpc, openai),
            on_started=lambda number, pid: sampler.watch(f"client{number}", pid),
            counter=counter,
        )
    finally:
        system = sampler.stop()
    records = [r for p in processes_out for r in p.records]
    result = summarize(records)
    result["workers"] = worker_curves(records, worker_devices(target) if not foreign else {})
    client_cpu_s = sum(p.cpu_s for p in processes_out)
    result["client"] = {
        "processes": processes,
        "cpu_s": client_cpu_s,
        "cpu_per_chunk_us": client_cpu_s / result["chunks"] * 1e6 if result["chunks"] else None,
        "busiest_process_cpu_share": max(p.cpu_s / p.wall_s for p in processes_out if p.wall_s),
        "schedule_slips": sum(p.schedule_slips for p in processes_out),
    }
    result["system"] = system
    result["workload"] = {
        "target": target,
        "requests": workload.requests,
        "duration_s": workload.duration_s,
        "concurrency": None if workload.rate else workload.concurrency,
        "rate": workload.rate,
        "max_tokens": list(workload.shape.max_tokens),
        "prompt_tokens": list(workload.shape.prompt_tokens),
        "prompts_from_file": len(workload.shape.prompts),
        "seed": workload.shape.seed,
        "read_delay_ms": workload.read_delay_ms,
        "client_processes": processes,
        "channels_per_process": channels,
        "protocol": protocol,
        "model": kserve.model if kserve is not None else openai.model if openai else None,
    }
    if openai is not None:
        result["workload"]["openai"] = {"base_url": openai.base_url,
                                        "endpoint": openai.endpoint}
    if grpc is not None:
        result["workload"]["grpc"] = {
            "method": grpc.schema.path, "types_from": grpc.schema.source,
            "bidirectional": grpc.schema.client_streaming, "request_json": grpc.request_json,
            "tokens_field": grpc.tokens_field or None, "index_field": grpc.index_field or None,
            "headers": sorted({k for k, _ in grpc.headers}),
        }
    if baseline:
        result["baseline"], result["overhead_ms"] = _baseline(target, workload, result)
    result["records"] = msgspec.to_builtins(records)
    result["diagnosis"] = diagnose(result)
    return result


def _server_to_sample(target: str, protocol: str, server_pid: int | None) -> dict[str, int]:
    """{name: pid} of the server's processes whose CPU the run samples; {} when unknown."""
    if server_pid:
        return {"server": server_pid}
    if protocol not in ("grpc", "openai"):
        return server_processes(target)
    pid = listener_pid(target)
    return {"server": pid} if pid else {}


_OVERHEAD_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def _baseline(target: str, workload: Workload, served: dict) -> tuple[dict, dict]:
    found = engine_config_of(target)
    if found is None:
        return {"error": "the engine-only baseline needs a cadence server on this host"}, {}
    config, workers = found
    records = run_baseline(config, workers, workload.shape, workload.requests,
                           workload.duration_s, workload.concurrency, workload.rate)
    engine_only = summarize(records)
    engine_only["workers"] = workers
    overhead = {
        m: {q: served[m][q] - engine_only[m][q] for q in ("mean", "p50", "p90", "p99", "max")}
        for m in _OVERHEAD_METRICS
    }
    return engine_only, overhead


def print_summary(result: dict) -> None:
    """A table of the aggregates (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    workload = result["workload"]
    title = f"cadence bench: {workload['target']}"
    if workload.get("protocol") == "kserve":
        title += f" (Open Inference Protocol, model {workload['model']})"
    elif workload.get("protocol") == "openai":
        title += f" (OpenAI {workload['openai']['endpoint']}, model {workload['model']})"
    elif workload.get("protocol") == "grpc":
        title += f" ({workload['grpc']['method']}, types from {workload['grpc']['types_from']})"
    table = Table(title=title, show_lines=False)
    table.add_column("metric")
    for col in ("mean", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="right")
    rows = ["ttft_ms", "itl_ms", "chunk_gap_ms", "tpot_ms", "e2e_ms", "token_delay_ms", "chunk_tokens"]
    for name in rows:
        d = result.get(name)
        if d:
            table.add_row(name, *(f"{d[c]:.2f}" for c in ("mean", "p50", "p90", "p99", "max")))
    for name, d in result.get("segments_ms", {}).items():
        table.add_row(f"  segment {name}", *(f"{d[c]:.2f}" for c in ("mean", "p50", "p90", "p99", "max")))
    console.print(table)
    if result.get("overhead_ms"):
        o = result["overhead_ms"]
        console.print("serving overhead (served − engine-only, ms): " + ", ".join(
            f"{m} p50 {o[m]['p50']:+.2f} p99 {o[m]['p99']:+.2f}" for m in o))
    elif result.get("baseline", {}).get("error"):
        console.print(f"baseline: {result['baseline']['error']}")
    client = result["client"]
    per_chunk = client["cpu_per_chunk_us"]
    console.print(
        f"client: {client['processes']} process(es), "
        + (f"{per_chunk:.0f} µs CPU per chunk, " if per_chunk is not None else "no chunks, ")
        + f"busiest process {client['busiest_process_cpu_share']:.0%} of a core"
        + (" (the client may be the bottleneck: add --procs)" if client["busiest_process_cpu_share"] > 0.8 else "")
    )
    for line in worker_lines(result.get("workers") or []):
        console.print(line, highlight=False)
    _print_system(console, result.get("system") or {})
    loop = result.get("front_loop")
    if loop and loop["samples"]:
        console.print(
            f"front event loop (from the timed streams): {loop['late_over_20ms']:.0f} of "
            f"{loop['samples']:.0f} timer wake-ups more than 20 ms late, p99 <= "
            f"{loop['p99_ms_at_most']:g} ms, max <= {loop['max_ms_at_most']:g} ms")
    integrity = result["integrity"]
    console.print(
        f"requests {result['requests_ok']}/{result['requests']} ok, errors {result['errors_by_code'] or 'none'}; "
        f"{result['output_tokens']} tokens in {result['chunks']} chunks over {result['wall_s']:.2f} s: "
        f"{result['tokens_per_s']:.0f} tokens/s, {result['chunks_per_s']:.0f} chunks/s, "
        f"{result['requests_per_s']:.1f} requests/s"
    )
    for code, message in (result.get("first_error_by_code") or {}).items():
        console.print(f"  {code}: {message}", highlight=False)
    grpc = workload.get("grpc")
    if grpc is not None and not grpc["index_field"]:
        console.print("integrity: not checked (the output's positions are unknown: give "
                      "--index-field)")
    else:
        console.print(
            f"integrity: lost {integrity['lost_tokens']}, repeated "
            f"{integrity['repeated_tokens']}, reordered {integrity['reordered_chunks']}, "
            f"short streams {integrity['short_streams']}")
    _print_diagnosis(console, result.get("diagnosis"))


def _print_diagnosis(console, findings: list[dict] | None) -> None:
    if findings is None:
        return
    if not findings:
        console.print("diagnosis: no rule fired")
    for f in findings:
        evidence = ", ".join(f"{k} {v}" for k, v in f["evidence"].items())
        console.print(f"[bold]diagnosis {f['rule']}:[/] {f['finding']}\n  evidence: {evidence}"
                      f"\n  look at: {f['look_at']}", highlight=False)


def _print_system(console, system: dict) -> None:
    cpu = ", ".join(f"{name} {p['cpu_pct_mean']:.0f}%" for name, p in system.get("processes", {}).items()
                    if p["cpu_pct_mean"] is not None)
    if cpu:
        console.print(f"CPU (mean, % of one core): {cpu}")
    for gpu in system.get("gpus", []):
        console.print(f"card {gpu['index']}: {gpu['util_pct_mean']:.0f}% utilised (mean), "
                      f"{gpu['mem_used_mb_max']:.0f} MiB at most")
    scraped = system.get("server_metrics")
    if scraped:
        during, peaks = scraped["during_run"], scraped["peaks"]
        console.print(
            f"server metrics ({scraped['scrapes']} scrapes): deepest request buffer "
            f"{peaks.get('cadence_deepest_buffer_steps', 0):.0f} steps, peak active streams "
            f"{peaks.get('cadence_active_streams', 0):.0f}; during the run "
            f"{during['cadence_merged_steps_total']:.0f} steps merged, "
            f"{during['cadence_buffer_overflows_total']:.0f} buffer overflows"
            + _blocking(during, peaks) + _front_loop(scraped.get("front_loop"))
        )
        for line in startup_lines(worker_startup(scraped)):
            console.print(line, highlight=False)
    for flag in system.get("flags", []):
        console.print(f"[bold red]{flag}[/]")


def _front_loop(loop: dict | None) -> str:
    """The front's event-loop lag over the run; empty when the server exported none."""
    if not loop or not loop["samples"]:
        return ""
    return (f"; front event loop late > 20 ms in {loop['late_over_20ms']:.0f} of "
            f"{loop['samples']:.0f} samples")


def _blocking(during: dict, peaks: dict) -> str:
    """The blocking the run saw (--overflow block): pauses issued, most paused at a scrape.
    Empty for a result saved before the server exported them."""
    if "cadence_sequence_pauses_total" not in during:
        return ""
    return (f"; blocking: {during['cadence_sequence_pauses_total']:.0f} sequence pauses, "
            f"{peaks.get('cadence_paused_sequences', 0):.0f} paused at the busiest scrape")


def worker_lines(workers: list[dict]) -> list[str]:
    """One line per worker's output curve (lab/worker_curves.py)."""
    return [
        f"worker {w['worker']}" + (f" ({w['device']})" if w.get("device") else "")
        + f": step p50 {w['step_ms_p50']:.1f} / p90 {w['step_ms_p90']:.1f} ms, "
        f"{w['sequences_per_step_p50']:.0f} sequences per step, {w['tokens_per_s']:,.0f} "
        f"tokens/s ({w['token_share']:.0%} of the run's), its streams' ITL p50 "
        f"{w['itl_ms_p50']:.1f} ms"
        for w in workers
    ]


def startup_lines(startup: list[dict]) -> list[str]:
    """One "start-up" line per worker (from `sampler.worker_startup`): model load, warm-up,
    and the cold first step against a warm one. All before the run, so none of it is in the
    serving latencies above; shown apart so a slow start is not read as slow serving."""
    lines = []
    for w in startup:
        if w["load_s"] is None:
            continue  # restarts only: nothing measured of this worker's start
        line = (f"start-up worker {w['worker']}: load {_ms(w['load_s'])}, warm-up "
                f"{_ms(w['warmup_s'])} (first step {_ms(w['first_step_s'])} vs warm step "
                f"{_ms(w['warm_step_s'])})")
        if w["restarts"]:
            line += (f"; {w['restarts']:.0f} restart(s), {w['restarts_during_run']:.0f} during "
                     "the run (the values are of the last start)")
        lines.append(line)
    return lines


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"
