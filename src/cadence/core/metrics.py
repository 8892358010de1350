"""The front's Prometheus metrics: one naming scheme (prefix `cadence_`, unit suffix,
`_total` on counters), explicit buckets, a `worker` label where a value is per worker and a
`protocol` label on the request-level ones (which front API the request came through)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from functools import partial
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from cadence.proto import loop_lag

_LAG_BUCKETS_S = loop_lag.BOUNDS_S
_LATENCY_BUCKETS_S = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
)
_DURATION_BUCKETS_S = (*_LATENCY_BUCKETS_S, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)
"""A whole request: long streams (tens of thousands of tokens) run for minutes, and with the
latency buckets alone every one of them would land in +Inf, hiding their quantiles. The
latency bounds are kept, so queries over them (`le="0.5"`) mean what they meant."""

CADENCE_V1 = "cadence.v1"
KSERVE = "kserve"
OPENAI = "openai"
PROTOCOLS = (CADENCE_V1, KSERVE, OPENAI)
"""The `protocol` label's values: cadence.v1.Inference, KServe v2 gRPC, OpenAI HTTP."""


class StreamTally:
    """What a front's request streams have done, counted as it happens by each `RequestStream`
    (chunks and tokens as they are handed to gRPC, pauses of the block policy as they are
    asked and lifted), so the counters move while long streams run, not only when they end.
    Read when /metrics is scraped. Plain ints: only the event loop's thread changes them, a
    scrape only reads them.
    """

    __slots__ = ("chunks", "merged_steps", "overflows", "paused", "pauses", "tokens")

    def __init__(self) -> None:
        self.chunks = 0
        self.tokens = 0
        self.merged_steps = 0
        self.overflows = 0
        self.pauses = 0
        """Pauses asked of the workers so far (a sequence paused again counts again)."""
        self.paused = 0
        """Sequences paused now: asked to pause, not yet resumed, failed or ended."""


class LoopLagTally:
    """The front's event-loop lag samples so far, counted per bucket of
    `cadence_event_loop_lag_seconds`, for the lab: a timed stream carries them in its trailing
    metadata, and in its initial metadata when they moved since a stream last carried them
    (`encoded`, in the form `cadence.proto.loop_lag` states), so a bench sees how late the loop
    woke during its run whether or not the server exports metrics."""

    __slots__ = ("counts", "front", "samples")

    KEY = loop_lag.KEY

    def __init__(self, front: int = 0) -> None:
        self.front = front
        self.samples = 0
        self.counts = [0] * (len(_LAG_BUCKETS_S) + 1)
        """Samples per bucket: <= each bound, the last one above every bound."""

    def observe(self, lag_s: float) -> None:
        self.samples += 1
        for k, bound in enumerate(_LAG_BUCKETS_S):
            if lag_s <= bound:
                self.counts[k] += 1
                return
        self.counts[-1] += 1

    def encoded(self) -> str:
        return loop_lag.encode(self.front, self.samples, self.counts)


class ProtocolMetrics:
    """One protocol's children of the request-level histograms, looked up once per protocol
    rather than per request or chunk, so a chunk's ITL costs one call whatever the labels."""

    __slots__ = ("e2e", "observe_itl", "protocol", "queue_wait", "ttft")

    def __init__(self, metrics: FrontMetrics, protocol: str) -> None:
        self.protocol = protocol
        self.ttft = metrics.ttft.labels(protocol)
        self.queue_wait = metrics.queue_wait.labels(protocol)
        self.e2e = metrics.e2e.labels(protocol)
        self.observe_itl = metrics.itl.labels(protocol).observe


class LoopHistogram:
    """A histogram observed on the event loop's thread only (per chunk, per request), with one
    label: per label value a count per bucket and a sum, plain numbers, made cumulative only
    when scraped. prometheus_client's Histogram takes a lock per bucket and for the sum on
    every observation, several times this one's cost, for threads the front does not have. As
    with prometheus_client's, a scrape reads the buckets one by one while the loop may
    observe: it can be one observation off."""

    __slots__ = ("_bounds", "_children", "documentation", "label", "name")

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self._bounds = tuple(buckets)
        self._children: dict[str, LoopCounts] = {}
        registry.register(self)

    def labels(self, value: str) -> LoopCounts:
        """The counts of one label value (made on first use; keep it, not the lookup)."""
        child = self._children.get(value)
        if child is None:
            child = self._children[value] = LoopCounts(self._bounds)
        return child

    def describe(self):
        return [HistogramMetricFamily(self.name, "", labels=[self.label])]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        bounds = (*map(floatToGoString, self._bounds), "+Inf")
        for value, child in list(self._children.items()):
            total, buckets = 0, []
            for bound, count in zip(bounds, list(child.counts), strict=True):
                total += count
                buckets.append((bound, total))
            family.add_metric([value], buckets, child.sum)
        yield family


class LoopCounts:
    """One label value's buckets of a `LoopHistogram`."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        """Observations per bucket, not cumulative: <= each bound (and above the previous),
        then above every bound."""
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class FrontMetrics:
    """Every metric the front exports. Observed per chunk or per request, never per token."""

    def __init__(self, registry: CollectorRegistry | None = None, front: int = 0) -> None:
        self.registry = registry or CollectorRegistry()
        self._http: WSGIServer | None = None
        r = self.registry
        self.ttft = LoopHistogram(
            "cadence_time_to_first_token_seconds",
            "From the front receiving a request to its first chunk handed to the protocol.",
            "protocol",
            _LATENCY_BUCKETS_S,
            r,
        )
        self.itl = LoopHistogram(
            "cadence_inter_token_latency_seconds",
            "Gap between a stream's consecutive chunks at the front, divided "
            "by the tokens in the later chunk.",
            "protocol",
            _LATENCY_BUCKETS_S,
            r,
        )
        self.e2e = LoopHistogram(
            "cadence_request_duration_seconds",
            "From the front receiving a request to its stream ending.",
            "protocol",
            _DURATION_BUCKETS_S,
            r,
        )
        self.queue_wait = LoopHistogram(
            "cadence_queue_wait_seconds",
            "From the front receiving a request to the engine step that admitted it.",
            "protocol",
            _LATENCY_BUCKETS_S,
            r,
        )
        self.loop_lag = Histogram(
            "cadence_event_loop_lag_seconds",
            "How late the front's event loop woke for a timer, sampled "
            "every --heartbeat-interval: time it spent in other callbacks.",
            buckets=_LAG_BUCKETS_S,
            registry=r,
        )
        self.requests = Counter(
            "cadence_requests_total",
            "Finished requests by gRPC status code (refusals included) and protocol.",
            ["code", "protocol"],
            registry=r,
        )
        self._by_protocol: dict[str, ProtocolMetrics] = {}
        self.failed_sends = Counter(
            "cadence_failed_sends_total",
            "Chunks whose send failed because the client had just "
            "cancelled (grpc.aio's ExecuteBatchError; not logged).",
            registry=r,
        )
        self.active = Gauge(
            "cadence_active_streams", "Streams admitted and not yet finished.", registry=r
        )
        self.batch_size = Gauge(
            "cadence_worker_batch_size",
            "Sequences in the worker's last engine step; 0 while it has no open request.",
            ["worker"],
            registry=r,
        )
        self.step_time = Gauge(
            "cadence_worker_step_seconds",
            "Duration of the worker's last engine step.",
            ["worker"],
            registry=r,
        )
        self.steps = Counter("cadence_worker_steps_total", "Engine steps.", ["worker"], registry=r)
        # vLLM's pair (prefix_cache_queries / _hits, in tokens): hit rate = hits / queries.
        self.prefix_cache_queries = Counter(
            "cadence_prefix_cache_queries_total",
            "Prompt tokens of the requests the worker started with --prefix-caching on.",
            ["worker"],
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "cadence_prefix_cache_hits_total",
            "Of those, prompt tokens whose keys and values the worker's prefix cache held "
            "(not computed again).",
            ["worker"],
            registry=r,
        )
        self.deepest_buffer = Gauge(
            "cadence_deepest_buffer_steps",
            "Steps of output waiting in the fullest per-request buffer (read at scrape time).",
            registry=r,
        )
        # Start-up, apart from serving latency: set on every WorkerReady, so a restarted
        # worker's values replace its predecessor's.
        self.worker_load = Gauge(
            "cadence_worker_load_seconds",
            "The worker's model load (engine built: weights read or "
            "created, cache allocated), at its last start.",
            ["worker"],
            registry=r,
        )
        self.worker_warmup = Gauge(
            "cadence_worker_warmup_seconds",
            "The worker's warm-up steps before it reported ready (health "
            "turns SERVING after them), at its last start.",
            ["worker"],
            registry=r,
        )
        self.worker_first_step = Gauge(
            "cadence_worker_first_step_seconds",
            "The worker's first (cold) engine step, during warm-up, at its last start.",
            ["worker"],
            registry=r,
        )
        self.worker_warm_step = Gauge(
            "cadence_worker_warm_step_seconds",
            "A decode step at the end of the worker's warm-up, to compare with the first step.",
            ["worker"],
            registry=r,
        )
        # Disaggregated serving (--prefill-devices): set only then.
        self.worker_role = Gauge(
            "cadence_worker_role",
            "1 for the worker's role in disaggregated serving: prefill (prompts and first "
            "tokens) or decode (handed-over sequences, and prompts up to --disaggregate-above).",
            ["worker", "role"],
            registry=r,
        )
        self.handoffs = Counter(
            "cadence_handoffs_total",
            "Sequences handed from a prefill worker to a decode worker.",
            registry=r,
        )
        self.handoffs_waiting = Gauge(
            "cadence_handoff_states_waiting",
            "Handed-over states held in the front until a decode worker has room "
            "(beyond --handoff-window).",
            registry=r,
        )
        self.handoffs_in_flight = Gauge(
            "cadence_handoff_states_in_flight",
            "Handed-over states sent to decode workers and not yet in their batches.",
            registry=r,
        )
        self.accept_ahead = Gauge(
            "cadence_accept_ahead_calls",
            "Incoming calls of each streaming method requested from gRPC "
            "ahead of their arrival (--accept-ahead); 0 when off, which "
            "this grpcio's internals may force (see the start-up log).",
            registry=r,
        )
        self._restarts = _RestartCollector(
            "cadence_worker_restarts_total",
            "Times the supervisor restarted the worker after it exited or hung.",
            "worker",
        )
        self._front_restarts = _RestartCollector(
            "cadence_front_restarts_total",
            "Times front 0 restarted front N (--fronts) after it exited.",
            "front",
        )
        self._restart_backoff = _RestartCollector(
            "cadence_worker_restart_backoff_seconds",
            (
                "The back-off before the worker's pending restart: 0 while it runs; 1 s, doubling "
                "to 30 s, while it keeps failing soon after each start."
            ),
            "worker",
            GaugeMetricFamily,
        )
        self._ejections = _RestartCollector(
            "cadence_worker_ejections_total",
            "Times the worker was taken out of routing and restarted because its last "
            "--worker-max-failed-steps engine steps all failed.",
            "worker",
        )
        r.register(self._restarts)
        r.register(self._ejections)
        r.register(self._front_restarts)
        r.register(self._restart_backoff)
        self.tally = StreamTally()
        self.loop_lag_tally = LoopLagTally(front)
        """Handed to every request stream, which counts into it."""
        r.register(_TallyCollector(self.tally))
        self._gateway = _GatewayGauges()
        r.register(self._gateway)

    def for_protocol(self, protocol: str) -> ProtocolMetrics:
        """The request-level histograms of `protocol` (one of PROTOCOLS)."""
        found = self._by_protocol.get(protocol)
        if found is None:
            found = self._by_protocol[protocol] = ProtocolMetrics(self, protocol)
        return found

    def watch(self, active: Callable[[], float], deepest_buffer: Callable[[], float]) -> None:
        """Gauges computed only when scraped, so they cost nothing per token."""
        self.active.set_function(active)
        self.deepest_buffer.set_function(deepest_buffer)

    def watch_handoffs(
        self, roles: Sequence[str], waiting: Callable[[], float], in_flight: Callable[[], float]
    ) -> None:
        """Disaggregated serving: each worker's role, and the hand-offs' gauges (read when
        scraped)."""
        for worker, role in enumerate(roles):
            self.worker_role.labels(str(worker), role).set(1)
        self.handoffs_waiting.set_function(waiting)
        self.handoffs_in_flight.set_function(in_flight)

    def watch_batches(self, batch_size: Callable[[int], float], workers: int) -> None:
        """`cadence_worker_batch_size` of each worker, `batch_size(worker)` when scraped."""
        for worker in range(workers):
            self.batch_size.labels(str(worker)).set_function(partial(batch_size, worker))

    def watch_gateway(
        self,
        model_name: str,
        waiting: Callable[[], float],
        running: Callable[[], float],
        kv_cache_usage: Callable[[], float],
    ) -> None:
        """The gauges an inference gateway's endpoint picker reads, under vLLM's names (see
        `_GatewayGauges`), read when scraped."""
        gauges = self._gateway
        gauges.model_name = model_name
        gauges.values = (waiting, running, kv_cache_usage)

    def worker_started(
        self, worker: int, load_s: float, warmup_s: float, first_step_s: float, warm_step_s: float
    ) -> None:
        """Record a worker's start-up (from its WorkerReady), replacing any earlier start's."""
        label = str(worker)
        self.worker_load.labels(label).set(load_s)
        self.worker_warmup.labels(label).set(warmup_s)
        self.worker_first_step.labels(label).set(first_step_s)
        self.worker_warm_step.labels(label).set(warm_step_s)

    def watch_restarts(
        self, restarts: Sequence[int], delays: Sequence[float] = (), ejections: Sequence[int] = ()
    ) -> None:
        """Export `cadence_worker_restarts_total` from the supervisor's per-worker counts
        (read when scraped, so a restart that never comes back ready still counts),
        `cadence_worker_restart_backoff_seconds` from its pending restarts' back-offs, and
        `cadence_worker_ejections_total` from its ejections of workers failing every step."""
        self._restarts.restarts = restarts
        self._restart_backoff.restarts = delays
        self._ejections.restarts = ejections

    def watch_front_restarts(self, restarts: Sequence[int]) -> None:
        """Export `cadence_front_restarts_total` from front 0's per-front counts."""
        self._front_restarts.restarts = restarts

    def serve(
        self, port: int, host: str, other_fronts: Callable[[], list[tuple[int, str]]] | None = None
    ) -> int:
        """Expose /metrics over HTTP (a background thread); returns the bound port.

        `other_fronts` (`--fronts N`, front 0): returns the other fronts' /metrics texts;
        the endpoint then shows every front's samples together, each with a `front` label.
        """
        registry = self.registry
        if other_fronts is not None:
            registry = CollectorRegistry()
            registry.register(_AllFronts(self.registry, other_fronts))
        self._http, _thread = start_http_server(port, addr=host, registry=registry)
        return self._http.server_port

    def close(self) -> None:
        """Stop the /metrics endpoint, if it runs."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _RestartCollector:
    """A restart counter (or the back-off gauge) by worker or front, read from the
    supervisor's counts.

    A collector, not a Counter, because the supervisor already keeps the count (and changes
    it where no metrics object is at hand); front 0 alone has a supervisor, so the other
    fronts export the family without samples.
    """

    def __init__(self, name: str, text: str, label: str, family=CounterMetricFamily) -> None:
        self._name, self._text, self._label, self._family = name, text, label, family
        self.restarts: Sequence[float] = ()

    def describe(self):
        return [self._family(self._name, "", labels=[self._label])]

    def collect(self):
        family = self._family(self._name, self._text, labels=[self._label])
        for index, count in enumerate(self.restarts):
            family.add_metric([str(index)], count)
        yield family


class _TallyCollector:
    """The counters (and one gauge) read from a `StreamTally` when scraped.

    The pause counter is not `cadence_paused_sequences_total`: a counter of that name claims
    the family `cadence_paused_sequences`, which the gauge needs (prometheus_client refuses
    both in one registry, and `_AllFronts` merges families by name).
    """

    _FAMILIES = (
        (
            CounterMetricFamily,
            "chunks",
            "cadence_chunks_total",
            "Chunks (stream messages) handed to gRPC for clients.",
        ),
        (
            CounterMetricFamily,
            "tokens",
            "cadence_output_tokens_total",
            "Tokens handed to gRPC for clients.",
        ),
        (
            CounterMetricFamily,
            "merged_steps",
            "cadence_merged_steps_total",
            (
                "Engine steps whose tokens went out in one chunk with an earlier step's, because "
                "the stream was not ready to send."
            ),
        ),
        (
            CounterMetricFamily,
            "overflows",
            "cadence_buffer_overflows_total",
            "Tokens that found a request's buffer at --queue-capacity.",
        ),
        (
            CounterMetricFamily,
            "pauses",
            "cadence_sequence_pauses_total",
            (
                "Sequences paused in the engine by --overflow block because their client read "
                "too slowly (pauses issued; a sequence paused again counts again)."
            ),
        ),
        (
            GaugeMetricFamily,
            "paused",
            "cadence_paused_sequences",
            "Sequences paused by --overflow block now, waiting for their client to read.",
        ),
    )

    def __init__(self, tally: StreamTally) -> None:
        self._tally = tally

    def describe(self):
        # Declared so the registry checks these names against every other metric's.
        return [family(name, "") for family, _, name, _ in self._FAMILIES]

    def collect(self):
        tally = self._tally
        for family, field, name, text in self._FAMILIES:
            yield family(name, text, value=getattr(tally, field))


class _GatewayGauges:
    """`vllm:num_requests_waiting`, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc`
    with vLLM's `model_name` label, beside cadence's own metrics: the names the Gateway API
    Inference Extension's endpoint picker and autoscalers read from any model server. One
    series per server (vLLM adds an `engine` label per engine core; cadence's queue is the
    front's, shared by its workers). What each means here: docs/deploy.md."""

    FAMILIES = (
        (
            "vllm:num_requests_waiting",
            "Requests admitted and waiting for a place in an engine step (no token yet).",
        ),
        (
            "vllm:num_requests_running",
            "Requests in the workers' engine steps (admitted into a batch, not finished).",
        ),
        (
            "vllm:kv_cache_usage_perc",
            (
                "KV-cache usage, the workers' mean; 1 means 100 percent usage (0: the engine has "
                "no KV cache)."
            ),
        ),
    )

    def __init__(self) -> None:
        self.model_name = ""
        self.values: tuple[Callable[[], float], ...] = (lambda: 0,) * 3

    def describe(self):
        return [GaugeMetricFamily(name, "", labels=["model_name"]) for name, _ in self.FAMILIES]

    def collect(self):
        for (name, text), value in zip(self.FAMILIES, self.values, strict=True):
            family = GaugeMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self.model_name], value())
            yield family


_ACROSS_FRONTS = {
    "vllm:num_requests_waiting": sum,
    "vllm:num_requests_running": sum,
    "vllm:kv_cache_usage_perc": max,
}
"""The gateway's gauges describe the server, not a front: with --fronts N, one series of
each, the fronts' counts summed (each front holds its own requests) and the largest KV use."""


class _AllFronts:
    """A collector: front 0's own metrics and the other fronts' (scraped at collect time),
    merged family by family with a `front` label on every sample."""

    def __init__(self, own: CollectorRegistry, others: Callable[[], list[tuple[int, str]]]) -> None:
        self._own = own
        self._others = others

    def collect(self):
        from prometheus_client.metrics_core import Metric
        from prometheus_client.parser import text_string_to_metric_families

        merged: dict[str, Metric] = {}
        across: dict[tuple[str, tuple], list] = {}
        sources = [(0, list(self._own.collect()))]
        for front, text in self._others():
            sources.append((front, list(text_string_to_metric_families(text))))
        for front, families in sources:
            for family in families:
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                if family.name in _ACROSS_FRONTS:
                    for sample in family.samples:
                        key = (sample.name, tuple(sorted(sample.labels.items())))
                        across.setdefault(key, []).append(sample.value)
                    continue
                for sample in family.samples:
                    # A sample about a front (front restarts) keeps its own label.
                    out.add_sample(
                        sample.name,
                        {"front": str(front), **sample.labels},
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
        for (name, labels), values in across.items():
            merged[name].add_sample(name, dict(labels), _ACROSS_FRONTS[name](values))
        yield from merged.values()
