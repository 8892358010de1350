"""The lab's results as typed structs: what `cadence bench` and `cadence sweep` return and write.

Their JSON keys are a contract (scripts outside this repository parse them), so the field
names, the field order and which keys may be absent follow what the lab has always written:

- a field typed `X | UnsetType` is a key that only some runs have (segments need server
  timing, `baseline` needs `--baseline`); UNSET leaves the key out, and UNSET is falsy;
- a field typed `X | None` is a key that is always written, null when there is nothing;
- every field has a default, so results written before a key existed still decode.

Write a result with `to_builtins` (then `json.dump`, which keeps NaN as the lab always wrote
it), read one with `msgspec.convert(json.load(f), BenchResult)`.
"""

from __future__ import annotations

import functools
import math

import msgspec
from msgspec import UNSET, UnsetType

from cadence.lab.records import RequestRecord, Saturation

Number = int | float
"""A figure that is an integer or not depending on the values it came from (a max of token
counts), written as it came."""


class Distribution(msgspec.Struct, kw_only=True):
    """Percentiles of one per-request or per-chunk quantity; NaN everywhere when count is 0."""

    count: int = 0
    mean: float = math.nan
    p50: float = math.nan
    p90: float = math.nan
    p99: float = math.nan
    max: Number = math.nan
    min: Number = math.nan
    p999: float | UnsetType = UNSET
    """The 99.9th percentile (interpolated: with fewer than 1,000 values, between the
    largest ones); unset in a result written before it was kept."""

    @property
    def usable(self) -> bool:
        """Values to reason about: some counted and every figure finite."""
        return self.count > 0 and all(
            math.isfinite(v) for v in (self.mean, self.p50, self.p90, self.p99, self.max)
        )


class Integrity(msgspec.Struct, kw_only=True):
    """Tokens lost, repeated or out of order, from every chunk's `index`; all must be 0."""

    lost_tokens: int = 0
    repeated_tokens: int = 0
    reordered_chunks: int = 0
    short_streams: int = 0
    """Streams that ended OK without a final chunk, or with fewer than max_tokens tokens
    after a LENGTH finish."""
    extra_events: int = 0
    """OpenAI (SSE), a server whose events carry no position of its own: text events beyond
    its own count of the stream's outputs (`usage.completion_tokens`), a duplicated event most
    often. Each text event is one position, whatever usage says."""
    usage_above_events: int = 0
    """Information, not a fault: the outputs such a server's usage counts beyond the text
    events that arrived, summed over its streams. Several tokens an event (usual for some
    servers) or events missing: without positions of the server's own, which cannot be told."""
    usage_above_events_streams: int = 0
    """The streams with `usage_above_events`."""


class Segments(msgspec.Struct, kw_only=True):
    """Where each chunk's time goes (server timing); see `cadence.lab.analysis.stats`."""

    client_to_front: Distribution = msgspec.field(default_factory=Distribution)
    queue: Distribution = msgspec.field(default_factory=Distribution)
    engine_step: Distribution = msgspec.field(default_factory=Distribution)
    transfer: Distribution = msgspec.field(default_factory=Distribution)
    buffer: Distribution = msgspec.field(default_factory=Distribution)
    send: Distribution = msgspec.field(default_factory=Distribution)


class TtftSegments(msgspec.Struct, kw_only=True):
    """The first chunk's path; the parts add up to TTFT exactly."""

    client_to_front: Distribution = msgspec.field(default_factory=Distribution)
    queue: Distribution = msgspec.field(default_factory=Distribution)
    first_step: Distribution = msgspec.field(default_factory=Distribution)
    transfer: Distribution = msgspec.field(default_factory=Distribution)
    buffer: Distribution = msgspec.field(default_factory=Distribution)
    send: Distribution = msgspec.field(default_factory=Distribution)


class HandOffSegments(msgspec.Struct, kw_only=True):
    """Disaggregated serving: where a handed-off request's time goes between its first token
    (on the prefill worker) and its second (on the decode worker), server timing, per request;
    see `cadence.lab.analysis.stats`."""

    requests: int = 0
    """Requests handed off."""
    export: Distribution = msgspec.field(default_factory=Distribution)
    """The first token's step end to the front's reading the state: the prefill worker's
    export and the state's way to the front."""
    to_decode: Distribution = msgspec.field(default_factory=Distribution)
    """The front's reading the state to the start of the decode worker's first step with the
    request: its wait in the front, its way to the decode worker and its wait for room."""
    by_prefill_worker: dict[str, int] = {}
    by_decode_worker: dict[str, int] = {}


class SegmentShares(msgspec.Struct, kw_only=True):
    """Each segment's mean over the sum of the means: of TTFT, and of a token's path."""

    ttft: dict[str, float] = {}
    token: dict[str, float] = {}


class Stalls(msgspec.Struct, kw_only=True):
    """Stretches in which no open stream got anything (`cadence.lab.analysis.timeline`)."""

    shared: int = 0
    shared_ms_p50: float = math.nan
    shared_ms_max: float = math.nan
    shared_time_share: float = 0.0
    streams_hit_min: int = 0
    streams_hit_p50: float = math.nan
    gaps: int = 0
    long_gaps: int = 0
    long_gaps_in_shared: int = 0


class Bursts(msgspec.Struct, kw_only=True):
    """The largest burst of requests opened at once and how its TTFTs spread."""

    largest: int = 0
    ttft_p10_ms: float = math.nan
    ttft_p50_ms: float = math.nan
    ttft_p90_ms: float = math.nan
    ttft_max_ms: float = math.nan
    opened_alone: int = 0
    alone_ttft_p50_ms: float = math.nan


class StreamConcurrency(msgspec.Struct, kw_only=True):
    """Peak open and receiving streams, and the share of the run spent capped."""

    peak_open: int = 0
    peak_receiving: int = 0
    capped_share: float = 0.0


class Timeline(msgspec.Struct, kw_only=True):
    """The streams' arrival times read together: evidence from client timestamps alone."""

    gap_p50_ms: float = math.nan
    stall_threshold_ms: float = math.nan
    stalls: Stalls = msgspec.field(default_factory=Stalls)
    bursts: Bursts = msgspec.field(default_factory=Bursts)
    concurrency: StreamConcurrency = msgspec.field(default_factory=StreamConcurrency)


class FrontLoop(msgspec.Struct, kw_only=True):
    """How late the front's event loop woke over the run, from the timed streams' tallies."""

    fronts: int = 0
    samples: int = 0
    late_over_20ms: int = 0
    late_share: float = 0.0
    p99_ms_at_most: float = math.nan
    max_ms_at_most: float = math.nan


class RunStats(msgspec.Struct, kw_only=True):
    """Every aggregate of a run's records (`cadence.lab.analysis.stats.summarize`)."""

    requests: int = 0
    requests_ok: int = 0
    errors_by_code: dict[str, int] = {}
    first_error_by_code: dict[str, str] = {}
    """Each error code's first message."""
    wall_s: float = math.nan
    output_tokens: int = 0
    chunks: int = 0
    requests_per_s: float = math.nan
    tokens_per_s: float = math.nan
    chunks_per_s: float = math.nan
    ttft_ms: Distribution = msgspec.field(default_factory=Distribution)
    itl_ms: Distribution = msgspec.field(default_factory=Distribution)
    chunk_gap_ms: Distribution = msgspec.field(default_factory=Distribution)
    tpot_ms: Distribution = msgspec.field(default_factory=Distribution)
    e2e_ms: Distribution = msgspec.field(default_factory=Distribution)
    chunk_tokens: Distribution = msgspec.field(default_factory=Distribution)
    integrity: Integrity = msgspec.field(default_factory=Integrity)
    timeline: Timeline | None = None
    front_loop: FrontLoop | None = None
    token_delay_ms: Distribution | UnsetType = UNSET
    """With server timing only, as the three below."""
    segments_ms: Segments | UnsetType = UNSET
    ttft_segments_ms: TtftSegments | UnsetType = UNSET
    segment_shares: SegmentShares | UnsetType = UNSET
    handoff_segments_ms: HandOffSegments | UnsetType = UNSET
    """Disaggregated serving (cadence, with timing): the hand-off's parts."""
    connect_ms: Distribution | UnsetType = UNSET
    """HTTP only (`--protocol openai`), as the one below: the connect (TCP, and TLS over https)
    of each request that opened a new connection; a part of its TTFT."""
    ttft_after_connect_ms: Distribution | UnsetType = UNSET
    """Each request's TTFT less its connect time (0 on a connection already open)."""
    ttft_from_schedule_ms: Distribution | UnsetType = UNSET
    """Open loop only, as the one below: TTFT counted from when the schedule meant the
    request to go, not from when it went (a client late to send hides no server delay)."""
    e2e_from_schedule_ms: Distribution | UnsetType = UNSET
    ttft_by_turn_ms: dict[str, Distribution] | UnsetType = UNSET
    """Conversations (and traces with sessions): TTFT of each turn, by its number ("1" the
    first)."""
    cached_tokens: CachedTokens | UnsetType = UNSET
    """Where the server reports the prompt tokens it had cached."""
    ttft_reasoning_ms: Distribution | UnsetType = UNSET
    """OpenAI, a server that streams reasoning apart from the answer: the time to its first
    reasoning output, as the one below to its first answer output, over the requests that
    had reasoning (`ttft_ms` is the first output of either)."""
    ttft_answer_ms: Distribution | UnsetType = UNSET
    cancelled_by_client: int | UnsetType = UNSET
    """Requests the client cancelled on purpose (`--cancel-ms`): not among `errors_by_code`."""
    by_population: dict[str, Population] | UnsetType = UNSET
    """Mixed clients (`--read-delay-ms MS@SHARE%`, `--cancel-ms`, `--deadline-ms`): each
    population's requests and figures."""
    by_class: dict[str, Population] | UnsetType = UNSET
    """Request classes (`--mix`): each class's requests and figures, and its goodput under
    its own SLO terms."""


class Population(msgspec.Struct, kw_only=True):
    """One client population's requests (`cadence.lab.analysis.stats`)."""

    requests: int = 0
    requests_ok: int = 0
    codes: dict[str, int] = {}
    """Every request's end by status code, OK and CLIENT_CANCELLED included."""
    ttft_ms: Distribution = msgspec.field(default_factory=Distribution)
    """Over the requests that got a first chunk, cancelled ones included."""
    itl_ms: Distribution = msgspec.field(default_factory=Distribution)
    e2e_ms: Distribution = msgspec.field(default_factory=Distribution)
    """Over the requests that ended OK."""
    prompt_tokens: Distribution | UnsetType = UNSET
    """Request classes: the prompt lengths sent, as the one below."""
    max_tokens: Distribution | UnsetType = UNSET
    goodput: Goodput | UnsetType = UNSET
    """A request class with SLO terms of its own: the class judged on them alone."""


class CachedTokens(msgspec.Struct, kw_only=True):
    """The prompt tokens the server said it had cached, over the requests it said it for."""

    requests: int = 0
    """Requests whose cached count the server reported."""
    per_request: Distribution = msgspec.field(default_factory=Distribution)
    share_of_prompt: float = math.nan
    """Cached tokens over the prompt tokens sent, summed over those requests."""


class WorkerCurve(msgspec.Struct, kw_only=True):
    """One worker's output curve (`cadence.lab.analysis.worker_curves`)."""

    worker: int
    device: str | None = None
    steps: int = 0
    step_ms_p50: float = math.nan
    step_ms_p90: float = math.nan
    sequences_per_step_p50: float = math.nan
    tokens_per_s: float = math.nan
    token_share: float = math.nan
    itl_ms_p50: float = math.nan
    series: list[tuple[float, float, int]] = []
    """[seconds from the run's first step, step ms, this run's sequences in it]."""
    role: str | UnsetType = UNSET
    """Disaggregated serving: "prefill" (prompts and first tokens) or "decode" (the rest of
    each handed-off stream, and prompts up to --disaggregate-above); absent: both."""
    busy_share: float | UnsetType = UNSET
    """Its steps' time over its own span (from its first step's start to its last step's
    end): near 1, it stepped back to back; the steps seen are those of this run's streams."""
    queue_ms_p50: float | UnsetType = UNSET
    """The requests whose first token it made: their wait from the front's receiving them to
    the start of the step that admitted them, p50 (NaN: it made none)."""


class Client(msgspec.Struct, kw_only=True):
    """The load-generating processes: their CPU, and how well they kept their schedule."""

    processes: int = 1
    cpu_s: float = 0.0
    cpu_per_chunk_us: float | None = None
    busiest_process_cpu_share: float | None = None
    schedule_slips: int = 0
    offered_rate_per_s: float | None | UnsetType = UNSET
    """Requests/s the open loop's schedule asked for (null in a closed loop)."""
    achieved_rate_per_s: float | None | UnsetType = UNSET
    schedule_lag_ms: Distribution | None | UnsetType = UNSET
    """Actual minus intended send time of each open-loop request (null in a closed loop)."""
    behind_schedule: bool | UnsetType = UNSET
    """The client fell behind its schedule: its figures are the client's, not the server's."""
    loop_lag_ms: Distribution | UnsetType = UNSET
    """How late the load processes' event loops ran a timer due every few milliseconds
    (`cadence.lab.load.loop_lateness`): the client's read lag. Unset in a result written
    before it was kept."""
    loop_stalls: list[tuple[int, int, int]] | UnsetType = UNSET
    """(process, from, to) of each stretch a load process's loop ran late
    (time.monotonic_ns): a read due then was stamped late by the client."""


class ProcessCpu(msgspec.Struct, kw_only=True):
    """One sampled process: % of one core, every `interval_s`."""

    pid: int | None = None
    cpu_pct_mean: float | None = None
    cpu_pct_max: float | None = None
    samples: list[tuple[float, float]] = []
    """[seconds since the sampler started, % of one core]."""
    age_s: float | UnsetType = UNSET
    """How long the process had been running when the sampler started (its start time from
    the OS): whether a worker's first steps in the run are its first since it started.
    Absent where unknown (and in results saved before it was kept)."""


class Gpu(msgspec.Struct, kw_only=True):
    index: int = 0
    util_pct_mean: float | None = None
    util_pct_max: float | None = None
    mem_used_mb_max: float | None = None
    samples: list[tuple[float, float, float]] = []
    """[seconds since the sampler started, utilisation %, memory used MiB]."""


class ScrapedFrontLoop(msgspec.Struct, kw_only=True):
    """The front's event-loop lag samples of the run, from its metrics page."""

    samples: float = 0.0
    late_over_20ms: float = 0.0


class ServerMetrics(msgspec.Struct, kw_only=True):
    """The server's /metrics page scraped during the run (`cadence.lab.measure.scrape`)."""

    url: str | None = None
    scrapes: int = 0
    peaks: dict[str, float] = {}
    during_run: dict[str, float] = {}
    """Each counter's growth from the first scrape to the last."""
    front_loop: ScrapedFrontLoop | None = None
    samples: list[tuple[float, dict[str, float]]] = []
    """[seconds since the sampler started, every scraped value by name{labels}]."""


class ScrapedSeries(msgspec.Struct, kw_only=True):
    """One series of a page scraped with `--scrape` (`cadence.lab.measure.prometheus`)."""

    url: str
    name: str
    """The sample's name as the page has it; a histogram's or summary's mean under its
    family's name."""
    labels: dict[str, str] = {}
    kind: str = "gauge"
    """gauge (its value), rate (a counter's growth per second, or a histogram's `_count`'s)
    or mean (what a histogram observed in each interval: growth of `_sum` over `_count`)."""
    points: list[tuple[float, float]] = []
    """[seconds since the sampler started, value]; a rate or mean at the end of its interval."""


class ScrapedRole(msgspec.Struct, kw_only=True):
    """One role (running, waiting, kv_cache_use, preempted) read from the metrics that known
    servers export for it, added up over label sets and endpoints (the KV cache: the fullest)."""

    metric: str = ""
    """The metric(s) it was read from."""
    urls: list[str] = []
    peak: float | None = None
    """Over the run's window (`run_window_s`)."""
    mean: float | None = None
    points: list[tuple[float, float]] = []
    """[seconds since the sampler started, value]."""


class ScrapedEndpoint(msgspec.Struct, kw_only=True):
    url: str
    server: str | None = None
    """The server its role metrics name (vllm, sglang, triton, tensorrt-llm, cadence); null
    when it exports none of them."""
    scrapes: int = 0
    failed_scrapes: int = 0
    first_error: str | None = None
    stopped: str | None = None
    """Why the page was read no more during the run: it was larger than the most read of one
    page, or not read within one scrape's time limit (one of the failed scrapes)."""
    series: int = 0
    dropped_series: int = 0
    """Series left out: over the label sets kept per name, or over the series kept."""
    dropped: list[str] = []
    """The names of the metrics some of whose series were left out (the first few)."""


class ScrapedMetrics(msgspec.Struct, kw_only=True):
    """`cadence bench --scrape URL`: any server's Prometheus page read during the run."""

    interval_s: float = 0.5
    started_ns: int = 0
    """`time.monotonic_ns()` at the axis's zero: a record's `start_ns` minus it, in seconds,
    is on the series' axis (the same as the CPU samples')."""
    run_window_s: tuple[float, float] | None = None
    """The first request's send and the last one's end on that axis."""
    endpoints: list[ScrapedEndpoint] = []
    roles: dict[str, ScrapedRole] = {}
    series: list[ScrapedSeries] = []
    prefix_cache: list[PrefixCacheHits] | UnsetType = UNSET
    """The prefix cache's hit rate of each worker (each label set) over the run, from the
    counters cadence and vLLM export (`cadence.lab.measure.prometheus.prefix_cache_hits`)."""


class PrefixCacheHits(msgspec.Struct, kw_only=True):
    """One label set's prefix-cache counters over the scrapes: prompt tokens looked up in the
    cache and found in it (vLLM's and cadence's queries and hits, counted in tokens)."""

    url: str
    labels: dict[str, str] = {}
    """e.g. {"worker": "0"} (cadence), {"engine": "0", "model_name": ...} (vLLM)."""
    metric: str = ""
    """The hits counter read."""
    query_tokens: float = 0.0
    hit_tokens: float = 0.0
    hit_rate: float | None = None
    """hit_tokens / query_tokens; null when nothing was looked up."""


class OtherProcess(msgspec.Struct, kw_only=True):
    """A process on the host outside the server, its children and the lab."""

    pid: int
    name: str
    cpu_pct: float
    """% of one core over the sampled time."""


class HostCpu(msgspec.Struct, kw_only=True):
    """The whole host's CPU over the run: what the server and the lab did not use went to
    other work."""

    cpus: int = 1
    busy_pct_mean: float | None = None
    """% of one core (up to 100 x cpus)."""
    samples: list[tuple[float, float, float]] = []
    """[seconds since the sampler started, the host's busy % and the lab's own process's %
    (100 = one core)]."""
    others: list[OtherProcess] = []
    """The busiest other processes (those alive at both ends of the sampling), busiest first."""
    wakeups: Distribution | None = None
    """How late a sleeping thread woke meanwhile (ms, `cadence.lab.measure.wakeups`); null
    when not measured."""


class System(msgspec.Struct, kw_only=True):
    """What `cadence.lab.measure.sampler.SystemSampler` saw during the run."""

    interval_s: float = 0.1
    processes: dict[str, ProcessCpu] = {}
    host: HostCpu | UnsetType = UNSET
    """The whole host's CPU (runs since the `host_contended` rule)."""
    gpus: list[Gpu] = []
    server_metrics: ServerMetrics | None = None
    flags: list[str] = []
    """The findings of the `cpu_busy_cards_idle` rule, kept here as results always had them."""


class OpenAIWorkload(msgspec.Struct, kw_only=True):
    base_url: str
    endpoint: str


class GrpcWorkload(msgspec.Struct, kw_only=True):
    method: str
    types_from: str
    bidirectional: bool = False
    request_json: str = ""
    tokens_field: str | None = None
    index_field: str | None = None
    headers: list[str] = []
    """The names of the metadata sent, never their values."""


class Workload(msgspec.Struct, kw_only=True):
    """What was sent, and to what."""

    target: str = ""
    requests: int | None = None
    duration_s: float | None = None
    concurrency: int | None = None
    """Null in an open loop."""
    rate: float | None = None
    max_tokens: list[int] = []
    """[low, high]."""
    prompt_tokens: list[int] = []
    prompts_from_file: int = 0
    seed: int | None = None
    read_delay_ms: float = 0.0
    client_processes: int = 1
    channels_per_process: int = 1
    protocol: str = "cadence"
    model: str | None = None
    openai: OpenAIWorkload | UnsetType = UNSET
    grpc: GrpcWorkload | UnsetType = UNSET
    trace: TraceWorkload | UnsetType = UNSET
    conversation: ConversationWorkload | UnsetType = UNSET
    mix: list[ClassWorkload] | UnsetType = UNSET
    """`--mix`: the request classes, each with its share, lengths and SLO terms."""
    rate_stages: list[list[float]] | UnsetType = UNSET
    """`--ramp`, `--stages`: [rate at start, rate at end, seconds] each (Infinity: it holds)."""
    warmup_s: float | UnsetType = UNSET
    """`--warmup-duration`: the first seconds' requests were sent, not counted."""
    prompt_length_distribution: str | UnsetType = UNSET
    """`--prompt-tokens` as a distribution (`lognormal:200,80`); `prompt_tokens` holds its
    bounds."""
    output_length_distribution: str | UnsetType = UNSET


class TraceWorkload(msgspec.Struct, kw_only=True):
    """`--trace`: the file replayed, the part of it and how fast."""

    file: str
    requests: int
    """Rows in the window."""
    span_s: float
    """The last row's send time, after the speed."""
    speed: float = 1.0
    window_s: list[float | None] = msgspec.field(default_factory=lambda: [0.0, None])
    block_tokens: int = 512
    with_hash_ids: int = 0
    """Rows whose prompts are built from hash blocks (shared prefixes)."""
    sessions: int = 0


class ClassWorkload(msgspec.Struct, kw_only=True):
    """One request class of `--mix` (`--class`)."""

    name: str
    share: float
    prompt_tokens: list[int] = []
    """[LO, HI] (a distribution's bounds)."""
    max_tokens: list[int] = []
    prompt_length_distribution: str | None = None
    output_length_distribution: str | None = None
    slo: list[str] = []


class ConversationWorkload(msgspec.Struct, kw_only=True):
    """`--sessions N --turns K --think-ms D`."""

    sessions: int
    turns: int
    think_ms: float = 0.0
    session_header: str | None = None


class EngineOnly(RunStats, kw_only=True):
    """`--baseline`: the workload replayed through the engine alone; or why it could not be."""

    workers: int | UnsetType = UNSET
    error: str | UnsetType = UNSET
    """Set alone: the baseline did not run (written as `{"error": ...}`)."""


class Overhead(msgspec.Struct, kw_only=True):
    """Served minus engine-only, ms."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float


ALARM = "alarm"
"""A finding's severity: a fault to act on (a rule that fires on a healthy server raises a
false alarm)."""
INFORMATION = "information"
"""A finding's severity: true of the run and worth knowing, not a fault (a light load, a CPU
engine's worker filling its core): it explains no tail, and the verdict does not count it."""


class Finding(msgspec.Struct, kw_only=True):
    """What a diagnosis rule found: one sentence, the numbers behind it, what to look at."""

    rule: str
    finding: str
    evidence: dict[str, int | float | str | None]
    look_at: str
    severity: str | UnsetType = UNSET
    """`alarm` or `information` (the diagnosis sets one on every finding); absent in a result
    written before severities, whose findings are alarms."""

    @property
    def alarm(self) -> bool:
        return self.severity != INFORMATION


class TailVerdict(msgspec.Struct, kw_only=True):
    """One tail against the bound of a healthy run (`cadence.lab.analysis.verdict`)."""

    metric: str
    """itl_ms or ttft_ms."""
    stat: str = "p99"
    value_ms: float = math.nan
    """The run's value of the stat."""
    p50_ms: float = math.nan
    bound_ms: float = math.nan
    """The most a healthy run's stat may be; how it is made is in `bound`."""
    bound: str = ""
    """The bound in words (1.5 x p50 + 5 ms, ...), with the noise floor's terms and sources."""
    noise_ms: float | None = None
    """The run's own noise floor the bound allows for (`cadence.lab.analysis.noise_floor`);
    null in results judged before it, and for a TTFT not judged against ITL."""
    noise_terms_ms: dict[str, float] = {}
    """The noise floor's measured terms: `timer_resolution`, `host_wakeups` (wake-up
    probe p99 x the hops of a token's way), `client_read_lag` (open-loop schedule lag p99)."""
    values: int = 0
    """How many values the stat was taken over."""
    state: str = "not_judged"
    """healthy, bad, or not_judged (too few values to say)."""
    explained_by: dict[str, float | None] = {}
    """Each finding that explains the bad tail: its share of the tail when the finding's
    evidence gives one, else null (it explains some, how much is not measured)."""
    unexplained_share: float | None = None
    """The share no finding explains (1 when none does; null when a finding without a share
    explains it, so the rest cannot be known)."""


class Verdict(msgspec.Struct, kw_only=True):
    """How the run ended: healthy only when its tails are near its medians, its output whole
    and its failures few (`cadence.lab.analysis.verdict`)."""

    state: str = "inconclusive"
    """healthy, unhealthy, or inconclusive (nothing bad, but too few values to judge a
    tail)."""
    line: str = ""
    """The verdict in one line, as the summary and the report lead with it."""
    tails: list[TailVerdict] = []
    problems: list[str] = []
    """What else makes the run unhealthy, one phrase each (integrity, failures, an abort)."""

    @property
    def healthy(self) -> bool:
        return self.state == "healthy"


class SloTerm(msgspec.Struct, frozen=True, kw_only=True):
    """One term of a latency SLO: METRIC_STAT_ms <= bound_ms (`--slo ttft_p99_ms=150`)."""

    metric: str
    stat: str
    bound_ms: float


class TermResult(msgspec.Struct, kw_only=True):
    """One SLO term against the run's own percentile."""

    bound_ms: float
    measured_ms: float = math.nan
    met: bool = False


class Goodput(msgspec.Struct, kw_only=True):
    """The run under its SLO (`cadence bench --slo`, `cadence.lab.analysis.goodput`)."""

    terms: dict[str, TermResult] = {}
    """Each term by its name (`ttft_p99_ms`): the run's percentile against the bound."""
    passed: bool = False
    """Every term met by the run's percentiles."""
    requests_per_s: float = math.nan
    """Good requests (every term met by the request's own values) per second of the run."""
    tokens_per_s: float = math.nan
    """Their tokens per second."""
    good_share: float = math.nan
    good_requests: int = 0


class ThreadGroup(msgspec.Struct, kw_only=True):
    """The server's threads of one name (numbers as N) over the run; percentages of one core."""

    name: str
    threads: int = 0
    processes: int = 0
    cpu_pct: float = 0.0
    busiest_thread_cpu_pct: float = 0.0
    wait_for_cpu_pct: float = 0.0
    """Time the group's threads were ready to run but waited for a CPU (schedstat)."""
    wait_share: float = 0.0
    """Waiting for a CPU over (running + waiting)."""
    voluntary_switches_per_s: float = 0.0
    involuntary_switches_per_s: float = 0.0


class ServerProcessThreads(msgspec.Struct, kw_only=True):
    """One of the server's processes over the run: its CPU and its busiest thread."""

    pid: int
    command: str = ""
    python: bool = False
    threads: int = 0
    cpu_pct: float = 0.0
    busiest_thread: str = ""
    busiest_thread_cpu_pct: float = 0.0
    busiest_thread_wait_pct: float = 0.0
    """How long the busiest thread was ready but waited for a CPU: with its CPU, what it
    asked for (a thread at a full core on a shared host gets less than one)."""


class StackSpot(msgspec.Struct, kw_only=True):
    """Where a thread group's threads were when sampled, and how often."""

    where: str
    """The innermost Python frame; "(idle)" when py-spy saw the thread waiting."""
    code: str | None = None
    """The innermost frame of the server's own code (not the standard library or a package)."""
    count: int = 0


class StackGroup(msgspec.Struct, kw_only=True):
    """A Python server's thread group as py-spy saw it during the run."""

    name: str
    threads: int = 0
    samples: int = 0
    spots: list[StackSpot] = []
    """The most frequent places, most frequent first."""


class ServerThreads(msgspec.Struct, kw_only=True):
    """Every thread of the server and its children (this host, /proc), over the run."""

    wall_s: float = 0.0
    pids: list[int] = []
    cpus: int = 1
    """The host's CPUs (what "the others idle" is measured against)."""
    threads: int = 0
    groups: list[ThreadGroup] = []
    processes: list[ServerProcessThreads] = []
    stacks: list[StackGroup] | None = None
    """What the Python server's thread groups were doing (py-spy); null without py-spy, or
    for cadence's own servers (their timing says more)."""
    py_spy: bool | None = None
    """Whether py-spy was installed on the host the bench ran on (the report offers it where
    it was not); null in a result written before this was recorded."""


class Http2Settings(msgspec.Struct, kw_only=True):
    """What a gRPC server announced in its first HTTP/2 SETTINGS frame, read before the run; a
    setting it left out is null (HTTP/2's default: no stream limit, a 65,535-byte window,
    16,384-byte frames)."""

    tls: bool = False
    max_concurrent_streams: int | None = None
    """Streams the server lets one connection have open at once."""
    initial_window_size: int | None = None
    max_frame_size: int | None = None
    max_header_list_size: int | None = None
    error: str | None = None
    """Why the settings could not be read (then the run went on without them)."""


class SpanTime(msgspec.Struct, kw_only=True):
    """A span's start and end, in ms from the request's send (client clock)."""

    name: str
    start_ms: float
    end_ms: float


class RequestSpans(msgspec.Struct, kw_only=True):
    """One request's server span (the outermost span the server sent for its trace), its
    children, and its TTFT split at the span's edges (analysis/server_spans.py); times in ms
    from the request's send. A part is null where the spans do not tell it."""

    request_id: str
    trace_id: str
    service: str = ""
    name: str = ""
    start_ms: float = math.nan
    end_ms: float = math.nan
    error: str | None = None
    children: list[SpanTime] = []
    ttft_ms: float | None = None
    before_ms: float | None = None
    inside_ms: float | None = None
    queue_ms: float | None = None
    prefill_ms: float | None = None
    inside_other_ms: float | None = None
    after_ms: float | None = None
    inside_or_after_ms: float | None = None
    """When the server does not say when it sent the first output: inside and after as one."""


class ServerSpans(msgspec.Struct, kw_only=True):
    """The server's own spans received during the run (`--otlp-receive`), joined to the
    requests by trace id."""

    port: int = 0
    spans_received: int = 0
    spans_dropped: int = 0
    sent: int = 0
    """Requests sent with a trace id."""
    matched: int = 0
    """Requests a span of the server came for."""
    foreign_traces: int = 0
    """Traces received that no request of the run started (the server's other work)."""
    services: list[str] = []
    clock_suspect: int = 0
    """Requests whose server span began before the request was sent: the server's clock
    disagrees with this host's, and before/after are off by the difference."""
    ttft_split_ms: dict[str, Distribution] = {}
    """TTFT's parts over the matched requests that got a first chunk: before, inside (queue,
    prefill, inside_other), after; or inside_or_after where the server does not say when it
    sent."""
    requests: list[RequestSpans] = []


class RunInfo(msgspec.Struct, kw_only=True):
    """When, where and with what a run was made."""

    started_at: str = ""
    """ISO-8601, UTC."""
    cadence_version: str | None = None
    grpcio_version: str | None = None
    python_version: str = ""
    host: str = ""
    cpu_count: int | None = None
    server_cmdline: list[str] | None = None
    server_process: str | None = None
    """The process serving the port when it is not `server_cmdline`'s own (Envoy's, with
    --grpc-server native): its name, pid and role."""


class DependenceCurve(msgspec.Struct, kw_only=True):
    """The strongest dependence of one latency, as the report draws it
    (`cadence.lab.analysis.dependence`): the latency's median and quartiles by bin of the
    variable (quantile bins of a numeric one; each position within a period; each group)."""

    latency: str
    """gap (between reads) or ttft."""
    variable: str
    shape: str = ""
    """linear, faster_than_linear, step, periodic, group, monotone; empty when it is not
    significant."""
    size: str = ""
    named: bool = False
    """Named by a finding (`itl_depends_on`, `ttft_depends_on`), else the table's strongest
    row, shown for what was ruled out."""
    strength: float = 0.0
    tail_share: float = 0.0
    period: int | None = None
    """For a period: K, and `x` is the position within it (its residue)."""
    x: list[float] = []
    labels: list[str] = []
    """For a group: each group's name (`x` is its index)."""
    median_ms: list[float] = []
    p25_ms: list[float] = []
    p75_ms: list[float] = []
    n: list[int] = []


class BenchResult(RunStats, kw_only=True):
    """What `cadence.lab.bench.run_bench` returns and `cadence bench --json` writes."""

    workers: list[WorkerCurve] | None = None
    """Per-worker output curves; null without server step timing."""
    client: Client = msgspec.field(default_factory=Client)
    system: System = msgspec.field(default_factory=System)
    workload: Workload = msgspec.field(default_factory=Workload)
    baseline: EngineOnly | UnsetType = UNSET
    overhead_ms: dict[str, Overhead] | UnsetType = UNSET
    records: list[RequestRecord] | UnsetType = UNSET
    """Every request's raw record; left out of a sweep's runs."""
    saturation: Saturation | UnsetType = UNSET
    """`--saturation-stop`: the windows judged, whether the run ended at the knee and at what
    rate (`cadence.lab.load.saturation`)."""
    diagnosis: list[Finding] = []
    run: RunInfo | UnsetType = UNSET
    http2: Http2Settings | UnsetType = UNSET
    """A gRPC target's HTTP/2 settings (not read over HTTP/1, i.e. --protocol openai)."""
    goodput: Goodput | UnsetType = UNSET
    """The run under the SLO of `--slo`; unset without one."""
    server_threads: ServerThreads | None | UnsetType = UNSET
    """The server's threads over the run, when its processes are on this host."""
    server_spans: ServerSpans | UnsetType = UNSET
    """The server's spans, with `--otlp-receive`."""
    aborted: str | None | UnsetType = UNSET
    """Why the bench stopped early (null when it ran to its end)."""
    scraped: ScrapedMetrics | UnsetType = UNSET
    """The pages of `--scrape` read during the run; unset without one."""
    verdict: Verdict | UnsetType = UNSET
    """How the run ended; unset in a result written before verdicts."""
    repeats: Repeats | UnsetType = UNSET
    """`--repeat N`: every run's value of the key figures, their mean and confidence interval
    (the rest of the result is the first run's)."""
    dependence: list[DependenceCurve] | UnsetType = UNSET
    """The strongest dependence of the gaps and of the first outputs, with what the report
    needs to draw it; unset without raw records or with too few values."""


class RepeatedFigure(msgspec.Struct, kw_only=True):
    """One figure over a bench's repeated runs (`cadence.lab.analysis.noise`)."""

    values: list[float] = []
    """Each run's value, in run order."""
    mean: float = math.nan
    stdev: float = math.nan
    ci95_low: float = math.nan
    """The 95% confidence interval of the mean (Student's t over the runs)."""
    ci95_high: float = math.nan


class Repeats(msgspec.Struct, kw_only=True):
    """`cadence bench --repeat N`: the runs' noise, figure by figure."""

    runs: int = 1
    figures: dict[str, RepeatedFigure] = {}


class Spread(msgspec.Struct, kw_only=True):
    """One metric over a sweep point's repeats."""

    mean: float
    min: float
    max: float
    stdev: float


class SweepRow(msgspec.Struct, kw_only=True):
    """One value's line of the sweep table; metrics absent when every run failed."""

    value: str
    values: dict[str, str] | UnsetType = UNSET
    """A grid point's value of each varied name."""
    failures: int | UnsetType = UNSET
    ttft_p50_ms: Spread | UnsetType = UNSET
    ttft_p99_ms: Spread | UnsetType = UNSET
    itl_mean_ms: Spread | UnsetType = UNSET
    itl_p90_ms: Spread | UnsetType = UNSET
    tokens_per_s: Spread | UnsetType = UNSET
    diagnosis: list[str] | UnsetType = UNSET
    """The rules that fired in any repeat of the point."""


class SweepPoint(msgspec.Struct, kw_only=True):
    value: str
    values: dict[str, str] | UnsetType = UNSET
    """A grid point's value of each varied name."""
    repeats: list[BenchResult] = []
    failed: bool | UnsetType = UNSET
    """Every repeat of the point failed."""
    failures: list[str] | UnsetType = UNSET


class Sweep(msgspec.Struct, kw_only=True):
    variable: str
    """The varied names joined by commas (one name unless a grid)."""
    variables: list[str] | UnsetType = UNSET
    target: str | UnsetType = UNSET
    """The running server swept (`--target`); unset when the sweep started its servers."""
    repeat: int = 1
    points: list[SweepPoint] = []
    table: list[SweepRow] = []
    server_cmd: str | UnsetType = UNSET
    serve_args: list[str] | UnsetType = UNSET


class SweepResult(msgspec.Struct, kw_only=True):
    """What `cadence.lab.sweep.run_sweep` returns and `cadence sweep --json` writes."""

    sweep: Sweep


class CapacityPoint(msgspec.Struct, kw_only=True):
    """One run of a capacity search: the load, its percentiles, whether it met the SLO."""

    value: float
    passed: bool
    client_limited: bool = False
    """The client, not the server, limited this run (client_saturated,
    client_behind_schedule): not counted as the server's."""
    ttft_p99_ms: float = math.nan
    itl_p99_ms: float = math.nan
    tokens_per_s: float = math.nan
    goodput_tokens_per_s: float = math.nan
    failed_terms: list[str] = []
    errors: int = 0
    diagnosis: list[str] = []
    """The rules that fired."""
    ttft_p99_parts_ms: dict[str, float] = {}
    """With cadence's timing: each part of TTFT at p99 (client_to_front, queue, ...)."""


class Capacity(msgspec.Struct, kw_only=True):
    """`cadence capacity`: the largest load that meets the SLO, and what binds it."""

    search: str
    """concurrency or rate."""
    slo: list[SloTerm] = []
    max_passing: float | None = None
    first_failing: float | None = None
    binding: list[str] = []
    """The SLO term(s) the first failing point missed."""
    reasons: dict[str, str] = {}
    """Why the first failing point missed each binding term, in one sentence (never empty):
    the findings that explain its tail, what no rule explains, or a median already over."""
    why: list[Finding] = []
    """The diagnosis at the first failing point: why capacity stops there."""
    knee: str | None = None
    """With cadence's timing: the part of TTFT that grew the most from the largest passing
    load to the first failing one, in one sentence."""
    client_limited_at: float | None = None
    """The search stopped here: the client limited the run (add --procs)."""
    points: list[CapacityPoint] = []
    runs: int = 0
    elapsed_s: float = 0.0
    range_edge: str | None = None
    """"high": every run at --high met the SLO, so the capacity is at least --high (raise
    it); "low": even --low missed it (lower it); null: the knee is inside the range."""
    knee_spread: list[float] = []
    """[lowest load with a run that missed the SLO, highest load with a run that met it]
    among the loads tried: where repeated runs disagree about the knee, the band they span
    (its bounds then cross max_passing and first_failing); else [max_passing, first_failing].
    Empty when the search did not reach a knee."""
    confirm_runs: int = 0
    """Runs each load at the knee (max_passing and first_failing) was given at least."""
    runs_by_value: dict[str, list[bool]] = {}
    """Every load tried ("%g"), each of its runs: met the SLO or not."""
    non_monotone: list[list[float]] = []
    """[lower load that missed, higher load that met] pairs the runs left after retries: the
    answer stays below every failure, never on a load above one."""


class CapacityResult(msgspec.Struct, kw_only=True):
    """What `cadence capacity --json` writes."""

    capacity: Capacity


_ADDED_LATER = {RequestRecord: "trace_id", Integrity: "extra_events"}
"""Structs that gained fields after they were first written, each with the first of those
fields: while they hold their defaults they are left out (`_leave_out_added`), so that a run
without them is written as before they existed (a record: no trace id, a connect time
unmeasured everywhere but over HTTP, a closed loop, no conversation, no cached count, no
steps' waits for a CPU;
Integrity: SSE's counts, 0 over any other protocol)."""


@functools.cache
def _added(cls: type[msgspec.Struct]) -> tuple[int, list[tuple[str, object]]]:
    """Where `cls`'s later fields start, and each field's (name, default)."""
    defaults = [
        (
            f.encode_name,
            # A list's default is a factory (a fresh [] each time): the value it makes.
            f.default_factory()
            if f.default is msgspec.NODEFAULT and f.default_factory is not msgspec.NODEFAULT
            else f.default,
        )
        for f in msgspec.structs.fields(cls)
    ]
    return cls.__struct_fields__.index(_ADDED_LATER[cls]), defaults


def _leave_out_added(written: dict | list | None, cls: type[msgspec.Struct]) -> None:
    """Leave out of `written` (a `cls` as plain data) its later fields that hold their
    defaults: a dict's keys; an array-like struct's values, from the end only."""
    first, defaults = _added(cls)
    if isinstance(written, dict):
        for name, default in defaults[first:]:
            if written.get(name, default) == default:
                written.pop(name, None)
    elif written:
        while len(written) > first and written[-1] == defaults[len(written) - 1][1]:
            written.pop()


def to_builtins(result: BenchResult | SweepResult) -> dict:
    """`result` as plain data for `json.dump`, keys as the lab has always written them."""
    out = msgspec.to_builtins(result)
    runs = (
        [(result, out)]
        if isinstance(result, BenchResult)
        else [
            (r, o)
            for p, po in zip(result.sweep.points, out["sweep"]["points"], strict=True)
            for r, o in zip(p.repeats, po["repeats"], strict=True)
        ]
    )
    for run, written in runs:
        if run.baseline and run.baseline.error:
            written["baseline"] = {"error": run.baseline.error}
        _leave_out_added(written.get("integrity"), Integrity)
        _leave_out_added((written.get("baseline") or {}).get("integrity"), Integrity)
        for record in written.get("records") or ():
            _leave_out_added(record, RequestRecord)
    return out
