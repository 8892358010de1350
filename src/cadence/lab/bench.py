"""`cadence bench`: drive a server with a fixed workload and report what the client saw."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec

from cadence.core.tracing import epoch_offset_ns
from cadence.credentials import ClientCredentials
from cadence.lab import results
from cadence.lab.analysis import dependence
from cadence.lab.analysis.diagnosis import RULE_CPU_BUSY_CARDS_IDLE, RunFacts, diagnose
from cadence.lab.analysis.diagnosis.dependence import tables as dependence_tables
from cadence.lab.analysis.goodput import goodput
from cadence.lab.analysis.schedule import schedule
from cadence.lab.analysis.server_spans import join_spans
from cadence.lab.analysis.stats import grouped, summarize
from cadence.lab.analysis.verdict import judge
from cadence.lab.analysis.worker_curves import worker_curves
from cadence.lab.load.cadence_v1 import CADENCE
from cadence.lab.load.lengths import Lengths
from cadence.lab.load.plan import RequestShape
from cadence.lab.load.processes import ProcessPlan, RequestCounter, run_load
from cadence.lab.load.target import Target, protocol_name
from cadence.lab.measure.discovery import (
    listener_pid,
    metrics_url,
    server_processes,
    worker_devices,
    worker_roles,
)
from cadence.lab.measure.http2 import read_settings
from cadence.lab.measure.prometheus import PageScraper, run_window
from cadence.lab.measure.run_context import run_context
from cadence.lab.measure.sampler import SystemSampler
from cadence.lab.measure.stacks import StackSampler
from cadence.lab.measure.threads import ThreadReader
from cadence.lab.measure.trace_receiver import TraceReceiver
from cadence.lab.options import recorded
from cadence.lab.percentile import distribution
from cadence.lab.records import ProcessResult, RequestRecord
from cadence.lab.servers.baseline import engine_config_of, run_baseline

STALL_LIMIT_S = 60.0
"""A request that gets no chunk for this long ends as STALLED, unless the run has a
per-request deadline (`Workload.timeout_s`) or its own limit: a server that stops answering
must not hold a bench for ever. A minute is far longer than any first token of a server
that is working, even with its queue deep."""


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
    stall_s: float | None = None
    """The stall limit (see `stall_limit_s`); 0: none."""
    stages: list[tuple[float, float, float]] = field(default_factory=list)
    """Open loop: the rate's ramps and steps, (rate at start, rate at end, seconds) each;
    `rate` is then the highest (`--rate LO:HI --ramp S`, `--stages`)."""
    warmup_s: float = 0.0
    """Requests sent in the run's first seconds are not counted (`--warmup-duration`)."""
    trace: results.TraceWorkload | None = None
    """What `shape.trace` was read from (`--trace`): the run is then open, on its times."""
    saturation_window_s: float = 0.0
    """With stages: end the run at the knee, judged over windows this long
    (`--saturation-stop`, `cadence.lab.load.saturation`); 0: never."""

    @property
    def offered_rate(self) -> float | None:
        """Requests/s the open loop's schedule asks for (a trace's: its rows over its span);
        None in a closed loop."""
        rows = self.shape.trace
        if rows:
            span = rows[-1].offset_s
            return len(rows) / span if span > 0 else None
        finite = [(r0, r1, s) for r0, r1, s in self.stages if s != float("inf")]
        if finite and len(finite) == len(self.stages):  # steps that end: their mean rate
            return sum((r0 + r1) / 2 * s for r0, r1, s in finite) / sum(s for *_, s in finite)
        return self.rate

    @property
    def stall_limit_s(self) -> float | None:
        """How long a request may go without a chunk: `stall_s` when given (0: for ever),
        else STALL_LIMIT_S unless `timeout_s` bounds every request already."""
        if self.stall_s is not None:
            return self.stall_s or None
        return None if self.timeout_s is not None else STALL_LIMIT_S

    def __post_init__(self) -> None:
        ends = bool(self.stages) and self.stages[-1][2] != float("inf")
        if self.requests is None and self.duration_s is None and not ends:
            raise ValueError("bound the run: give a number of requests, a duration, or both")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")

    def plans(
        self,
        target: str,
        processes: int,
        channels: int = 1,
        credentials: ClientCredentials | None = None,
        protocol: Target = CADENCE,
    ) -> list[ProcessPlan]:
        """Split the requests and the concurrency evenly over `processes` client processes,
        each speaking `protocol`."""
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
                stages=self.stages,
                warmup_s=self.warmup_s,
                include_timing=self.include_timing,
                timeout_s=self.timeout_s,
                stall_s=self.stall_limit_s,
                channels=channels,
                warmup=self.warmup,
                read_delay_ms=self.read_delay_ms,
                credentials=credentials,
                protocol=protocol,
                saturation_window_s=self.saturation_window_s,
            )
            for p in range(processes)
        ]


def run_bench(
    target: str,
    workload: Workload,
    processes: int = 1,
    channels: int = 1,
    baseline: bool = False,
    credentials: ClientCredentials | None = None,
    protocol: Target = CADENCE,
    counter: RequestCounter | None = None,
    server_pid: int | None = None,
    slo: Sequence[results.SloTerm] = (),
    scrape: Sequence[str] = (),
    traces: TraceReceiver | None = None,
    traces_wait_s: float = 10.0,
) -> results.BenchResult:
    """Run `workload` against `target`; return the summary plus the raw records.

    With `baseline`, also replay the workload through the server's engine alone (the server
    must run on this host) and report serving overhead = served − engine-only.
    `credentials` are for a server started with TLS or bearer tokens. `protocol` is what the
    requests speak (lab/load/target.py): cadence's own (the default), a `KServeTarget` (that
    model over the Open Inference Protocol, any server of it; no server timing, so no
    segments), a `GrpcTarget` (that method of any gRPC service; no server timing either) or
    an `OpenAITarget`.
    `counter` counts finished requests while the load runs, for a progress display
    (lab/load/progress.py); it changes nothing in the result. `server_pid` names the server process
    whose CPU to sample (default: cadence's processes, or for any other server, the process
    listening on the target's port when it is on this host). `scrape`: Prometheus pages of any
    server to read during the run (`cadence.lab.measure.prometheus`), into the result's
    `scraped`. `traces`: a started OTLP receiver the server sends its spans to; after the run
    the bench waits up to `traces_wait_s` for every request's spans and joins them to the
    requests (`server_spans`).

    The run goes in stages, each a function below: plan, measure, drive, collect, analyse,
    report.
    """
    plan = _plan(target, workload, processes, channels, credentials, protocol, server_pid)
    measuring = _measure(plan, credentials, scrape)
    out = _drive(plan, measuring, counter)
    run = _collect(measuring, out, traces, traces_wait_s)
    result = _analyse(plan, run, slo, traces)
    if baseline:
        result.baseline, result.overhead_ms = _baseline(plan.address, workload, result)
    return judged(result)


@dataclass(frozen=True)
class _Plan:
    """What the run sends, to which server, and which of the server's processes it watches."""

    address: str
    """The server's HOST:PORT."""
    protocol: Target
    workload: Workload
    processes: list[ProcessPlan]
    """One plan per client process."""
    server: dict[str, int]
    """{name: pid} of the server's processes the run samples (`_server_to_sample`)."""
    record: results.Workload
    """What the result says was sent, and to what."""


def _plan(
    target: str,
    workload: Workload,
    processes: int,
    channels: int,
    credentials: ClientCredentials | None,
    protocol: Target,
    server_pid: int | None,
) -> _Plan:
    address = protocol.address(target)
    record = _workload_record(address, workload, processes, channels, protocol)
    return _Plan(
        address=address,
        protocol=protocol,
        workload=workload,
        processes=workload.plans(address, processes, channels, credentials, protocol),
        server=_server_to_sample(address, protocol, server_pid),
        record=record,
    )


@dataclass
class _Measuring:
    """What reads the server and the host while the run lasts (lab/measure/)."""

    started_at: datetime
    http2: results.Http2Settings | msgspec.UnsetType
    sampler: SystemSampler
    threads: ThreadReader
    stacks: StackSampler
    pages: PageScraper | None
    system: results.System | None = None

    def run_starts(self) -> None:
        self.threads.start()
        self.stacks.start()

    def stop_sampling(self) -> None:
        self.system = self.sampler.stop()
        if self.pages is not None:
            self.pages.stop()


def _measure(
    plan: _Plan, credentials: ClientCredentials | None, scrape: Sequence[str]
) -> _Measuring:
    """Read what is read before the run and start what samples during it."""
    protocol = plan.protocol
    started_at = datetime.now(UTC)
    # Before the run: the connection it opens would be one more on the server meanwhile.
    http2 = read_settings(plan.address, credentials) if protocol.HTTP2_SETTINGS else msgspec.UNSET
    sampler = SystemSampler(
        metrics_url=metrics_url(plan.address) if protocol.CADENCE_SERVER else None
    )
    for process_name, pid in plan.server.items():
        sampler.watch(process_name, pid)
    # A server that times every hop says more than its stacks; any other gets py-spy.
    roots = _roots(plan.server)
    measuring = _Measuring(
        started_at=started_at,
        http2=http2,
        sampler=sampler,
        threads=ThreadReader(roots),
        stacks=StackSampler(roots if not protocol.SERVER_TIMING else []),
        pages=None,
    )
    sampler.start()
    measuring.pages = PageScraper(scrape, sampler.started_ns).start() if scrape else None
    return measuring


def _drive(
    plan: _Plan, measuring: _Measuring, counter: RequestCounter | None
) -> list[ProcessResult]:
    """Send the load from the client processes; the sampling stops however it ends."""
    try:
        return run_load(
            plan.processes,
            on_started=lambda number, pid: measuring.sampler.watch(f"client{number}", pid),
            counter=counter,
            on_start=measuring.run_starts,
        )
    finally:
        measuring.stop_sampling()


@dataclass(frozen=True)
class _Run:
    """What the run left: the client processes' results, their records, the server's
    threads."""

    measuring: _Measuring
    processes: list[ProcessResult]
    records: list[RequestRecord]
    server_threads: results.ServerThreads | None


def _collect(
    measuring: _Measuring,
    out: list[ProcessResult],
    traces: TraceReceiver | None,
    traces_wait_s: float,
) -> _Run:
    """Stop what still samples, gather the records, and wait for the server's spans."""
    server_threads = measuring.threads.stop()
    if server_threads is not None:
        server_threads.stacks = measuring.stacks.stop()
        server_threads.py_spy = measuring.stacks.installed
    records = [r for p in out for r in p.records]
    if traces is not None:
        traces.wait_for({r.trace_id for r in records if r.trace_id}, traces_wait_s)
    return _Run(measuring=measuring, processes=out, records=records, server_threads=server_threads)


def _worker_specs(plan: _Plan) -> tuple[dict[int, str], dict[int, str]]:
    """Each worker's devices and role, from a cadence server's processes on this host."""
    if not plan.protocol.CADENCE_SERVER:
        return {}, {}
    return worker_devices(plan.address), worker_roles(plan.address)


def _analyse(
    plan: _Plan, run: _Run, slo: Sequence[results.SloTerm], traces: TraceReceiver | None
) -> results.BenchResult:
    """The run's aggregates from its records and measurements (lab/analysis/)."""
    workload, records, out = plan.workload, run.records, run.processes
    measuring = run.measuring
    assert measuring.system is not None  # _drive stopped the sampling, however the run ended
    stats = summarize(records)
    client_cpu_s = sum(p.cpu_s for p in out)
    result = results.BenchResult(
        **msgspec.structs.asdict(stats),
        workers=worker_curves(records, *_worker_specs(plan)),
        client=results.Client(
            processes=len(plan.processes),
            cpu_s=client_cpu_s,
            cpu_per_chunk_us=client_cpu_s / stats.chunks * 1e6 if stats.chunks else None,
            busiest_process_cpu_share=max(p.cpu_s / p.wall_s for p in out if p.wall_s),
            schedule_slips=sum(p.schedule_slips for p in out),
            loop_lag_ms=distribution(lag for p in out for lag in p.loop_late_ms),
            loop_stalls=sorted((p.process, *stall) for p in out for stall in p.loop_stalls),
            **schedule(
                workload.offered_rate, out, open_loop=bool(workload.rate or workload.shape.trace)
            ),
        ),
        system=measuring.system,
        workload=plan.record,
        records=records,
        aborted=next((p.aborted for p in out if p.aborted), None),
        run=run_context(measuring.started_at, next(iter(plan.server.values()), None)),
        http2=measuring.http2,
        server_threads=run.server_threads,
    )
    watched = [p.saturation for p in out if p.saturation is not None]
    if watched:
        result.saturation = next((w for w in watched if w.stopped), watched[0])
    if measuring.pages is not None:
        result.scraped = measuring.pages.result(run_window(records, measuring.sampler.started_ns))
    if traces is not None:
        result.server_spans = join_spans(
            records, traces.spans(), epoch_offset_ns(), traces.port, traces.dropped
        )
    if slo:
        result.goodput = goodput(records, list(slo), stats)
    if workload.shape.mix is not None and result.by_class:
        _class_goodput(result.by_class, workload.shape.mix, records, stats.wall_s)
    return result


def judged(result: results.BenchResult) -> results.BenchResult:
    """The run's diagnosis and verdict, written into its result (made anew: a kept result read
    again with the rules of the day, `benchmarks/false_alarms.py --reread`)."""
    facts = RunFacts(result)
    result.diagnosis = diagnose(result, facts)
    tables = dependence_tables(facts)
    result.dependence = dependence.curves(tables) or msgspec.UNSET
    result.verdict, unexplained = judge(result, tables)
    result.diagnosis += unexplained
    result.system.flags = [
        f.finding for f in result.diagnosis if f.rule == RULE_CPU_BUSY_CARDS_IDLE
    ]
    return result


def _workload_record(
    address: str, workload: Workload, processes: int, channels: int, protocol: Target
) -> results.Workload:
    """What the result says was sent, and to what: each entry that holds one load option as
    the option declares it (cadence.lab.options, `Flag.record`), then those built of several
    or of what the bench is given beside the load (the options' DERIVED entries)."""
    record = results.Workload(
        **recorded(workload),
        target=address,
        client_processes=processes,
        channels_per_process=channels,
        rate_stages=[list(s) for s in workload.stages] or msgspec.UNSET,
        trace=(
            workload.trace or described_trace(workload.shape)
            if workload.shape.trace
            else msgspec.UNSET
        ),
        conversation=_conversation(workload.shape),
        mix=_mix(workload.shape),
        protocol=protocol_name(protocol),
    )
    protocol.describe(record)  # its model, and its own entry (`openai`, `grpc`)
    return record


def _class_goodput(by_class: dict[str, results.Population], mix, records, wall_s: float) -> None:
    """Each request class with SLO terms of its own: its goodput on them, over the run's
    wall time."""
    from cadence.lab.analysis.goodput import parse_term

    groups = grouped(records, "request_class")
    for cls in mix.classes:
        if cls.slo and cls.name in by_class:
            group = groups[cls.name]
            stats = msgspec.structs.replace(summarize(group), wall_s=wall_s)
            by_class[cls.name].goodput = goodput(group, [parse_term(t) for t in cls.slo], stats)


def described_trace(
    shape: RequestShape,
    file: str = "",
    speed: float = 1.0,
    window: tuple[float, float | None] = (0.0, None),
) -> results.TraceWorkload:
    """What the result says of the trace `shape` replays (read from `file`, ...)."""
    rows = shape.trace
    return results.TraceWorkload(
        file=file,
        requests=len(rows),
        span_s=rows[-1].offset_s,
        speed=speed,
        window_s=list(window),
        block_tokens=shape.block_tokens,
        with_hash_ids=sum(1 for r in rows if r.hash_ids),
        sessions=len({r.session for r in rows if r.session}),
    )


def _conversation(shape: RequestShape) -> results.ConversationWorkload | msgspec.UnsetType:
    c = shape.conversation
    if c is None:
        return msgspec.UNSET
    return results.ConversationWorkload(
        sessions=c.sessions,
        turns=c.turns,
        think_ms=c.think_ms,
        session_header=shape.session_header or None,
    )


def _mix(shape: RequestShape) -> list[results.ClassWorkload] | msgspec.UnsetType:
    mix = shape.mix
    if mix is None:
        return msgspec.UNSET
    return [
        results.ClassWorkload(
            name=c.name,
            share=share,
            prompt_tokens=list(c.prompt_tokens),
            max_tokens=list(c.max_tokens),
            prompt_length_distribution=_said(c.prompt_lengths),
            output_length_distribution=_said(c.output_lengths),
            slo=c.slo,
        )
        for c, share in zip(mix.classes, mix.shares, strict=True)
    ]


def _said(lengths: Lengths | None) -> str | None:
    """A class's length distribution as the record says it; null for N or LO:HI."""
    return lengths.said if lengths is not None else None


def _roots(server: dict[str, int]) -> list[int]:
    """The server's processes whose threads (with their children's) the run reads: the front
    or the one server process; a cadence front's children are its workers and other fronts."""
    first = next(iter(server.values()), None)
    return [first] if first is not None else []


def _server_to_sample(target: str, protocol: Target, server_pid: int | None) -> dict[str, int]:
    """{name: pid} of the server's processes whose CPU the run samples, the front (or the
    one server process) first; {} when unknown."""
    if server_pid:
        return {"server": server_pid}
    if protocol.CADENCE_SERVER:
        return server_processes(target)
    pid = listener_pid(target)
    return {"server": pid} if pid else {}


_OVERHEAD_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def _baseline(
    target: str, workload: Workload, served: results.BenchResult
) -> tuple[results.EngineOnly, dict[str, results.Overhead]]:
    found = engine_config_of(target)
    if found is None:
        return results.EngineOnly(
            error="the engine-only baseline needs a cadence server on this host"
        ), {}
    config, workers = found
    records = run_baseline(
        config,
        workers,
        workload.shape,
        workload.requests,
        workload.duration_s,
        workload.concurrency,
        workload.rate,
    )
    engine_only = results.EngineOnly(**msgspec.structs.asdict(summarize(records)), workers=workers)
    overhead = {
        m: results.Overhead(
            **{
                q: getattr(getattr(served, m), q) - getattr(getattr(engine_only, m), q)
                for q in ("mean", "p50", "p90", "p99", "max")
            }
        )
        for m in _OVERHEAD_METRICS
    }
    return engine_only, overhead
