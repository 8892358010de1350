"""Any server's Prometheus metrics page scraped during a run (`cadence bench --scrape URL`).

Every gauge is kept as its value and every counter as its rate per second, on the run's time
axis (the sampler's: seconds since it started); a histogram or summary becomes the rate of
its `_count` and the mean of what it observed in each interval (the growth of `_sum` over
the growth of `_count`); buckets and quantiles are left out. The names that known servers
export for the requests running, the requests waiting and the KV cache in use are read
under those roles (ROLE_*), which the diagnosis reads without knowing the server.

cadence's own page is read apart as well (`scrape.py`, with `--metrics-port`); this module
knows nothing of a server but what its page says.
"""

from __future__ import annotations

import http.client
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from cadence.lab.results import ScrapedEndpoint, ScrapedMetrics, ScrapedRole, ScrapedSeries

ROLE_RUNNING = "running"
ROLE_WAITING = "waiting"
ROLE_KV_CACHE_USE = "kv_cache_use"
ROLE_PREEMPTED = "preempted"
ROLES = (ROLE_RUNNING, ROLE_WAITING, ROLE_KV_CACHE_USE, ROLE_PREEMPTED)
"""Requests in the server's running batch, requests queued for it, the share of its KV cache
in use (0 to 1), and requests preempted per second."""

SCRAPE_INTERVAL_S = 0.5
"""Often enough to see a queue build up within a short run; a page of a few hundred series
parses in milliseconds, so the server hardly notices."""
SCRAPE_TIMEOUT_S = 2.0
MAX_SERIES = 64
"""Series kept per endpoint (a role's series always, and counted): a server with a histogram
per model, adapter and engine would otherwise make a result of megabytes."""
MAX_LABEL_SETS = 8
"""Label sets kept per metric name (the rest dropped, with a note)."""
MAX_POINTS = 1200
"""Points kept per series: a long run is thinned evenly to this many (ten minutes at the
scrape interval fit whole)."""


@dataclass(frozen=True)
class Known:
    """A sample that a known server exports for a role; `labels` must match when given."""

    name: str
    role: str
    server: str
    labels: tuple[tuple[str, str], ...] = ()


KNOWN = (
    Known("vllm:num_requests_running", ROLE_RUNNING, "vllm"),
    Known("vllm:num_requests_waiting", ROLE_WAITING, "vllm"),
    Known("vllm:kv_cache_usage_perc", ROLE_KV_CACHE_USE, "vllm"),
    Known("vllm:gpu_cache_usage_perc", ROLE_KV_CACHE_USE, "vllm"),
    Known("vllm:num_preemptions_total", ROLE_PREEMPTED, "vllm"),
    Known("sglang:num_running_reqs", ROLE_RUNNING, "sglang"),
    Known("sglang:num_queue_reqs", ROLE_WAITING, "sglang"),
    Known("sglang:token_usage", ROLE_KV_CACHE_USE, "sglang"),
    Known("nv_trt_llm_request_metrics", ROLE_RUNNING, "triton",
          (("request_type", "scheduled"),)),
    Known("nv_trt_llm_request_metrics", ROLE_WAITING, "triton", (("request_type", "waiting"),)),
    Known("nv_trt_llm_kv_cache_block_metrics", ROLE_KV_CACHE_USE, "triton",
          (("kv_cache_block_type", "fraction"),)),
    Known("nv_inference_pending_request_count", ROLE_WAITING, "triton"),
    Known("trtllm_num_requests_running", ROLE_RUNNING, "tensorrt-llm"),
    Known("trtllm_num_requests_waiting", ROLE_WAITING, "tensorrt-llm"),
    Known("trtllm_kv_cache_utilization", ROLE_KV_CACHE_USE, "tensorrt-llm"),
    Known("cadence_worker_batch_size", ROLE_RUNNING, "cadence"),
)
"""For each role, the first of its entries that a page has is the one read (a Triton server
with the TensorRT-LLM backend has both its own queue and Triton's, which would count the same
requests twice); its label sets are added up (models, data-parallel engines, workers), the KV
cache's taken at their fullest. The vLLM, SGLang and TensorRT-LLM KV gauges are fractions
(vLLM's `_perc` too). Plain Triton exports no gauge of running requests (its
`nv_inference_exec_count` counts executions), so only its queue has a role. cadence has no
queue of its own to export: its requests wait in the front (its timing shows where)."""

_FULLEST = (ROLE_KV_CACHE_USE,)
"""Roles whose label sets (and endpoints) are combined by their largest value, not a sum: the
fullest cache is the one that stops admissions."""


class ScrapeError(RuntimeError):
    """A page that could not be read or is not a Prometheus page."""


def read_page(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> list[tuple[str, str, dict, float]]:
    """Every sample of the page at `url` as (family type, sample name, labels, value); raises
    ScrapeError, worded for one line, when it cannot be had."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            text = reply.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise ScrapeError(f"HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise ScrapeError(str(exc.reason)) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ScrapeError(f"{type(exc).__name__}: {exc}") from None
    return parse_page(text)


def parse_page(text: str) -> list[tuple[str, str, dict, float]]:
    """Every sample of a page's text (see `read_page`); raises ScrapeError when it is not in
    the Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [(family.type, s.name, s.labels, float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError) as exc:
        first = text.strip().splitlines()[0][:60] if text.strip() else ""
        raise ScrapeError(f"not a Prometheus metrics page ({str(exc)[:80]}; it begins "
                          f"{first!r})") from None


def check_scrape_url(url: str) -> None:
    """Read the page once before a run; raises ScrapeError (one line) when it cannot be read
    or holds no sample, so a mistyped URL stops the bench before the load goes out."""
    if not url.startswith(("http://", "https://")):
        raise ScrapeError("expected an http:// or https:// URL")
    if not read_page(url):
        raise ScrapeError("the page holds no metric")


Key = tuple[str, tuple[tuple[str, str], ...]]
"""A series on one page: its sample name and its sorted labels."""


@dataclass
class _Sample:
    kind: str
    """gauge, counter, or sum/count of a histogram or summary named by its family."""
    family: str
    value: float


@dataclass
class _Endpoint:
    url: str
    scrapes: list[tuple[int, float, dict[Key, _Sample]]] = field(default_factory=list)
    """(tick, seconds on the run's axis when the page was read, every kept sample)."""
    ticks: dict[int, float] = field(default_factory=dict)
    """Each tick's start on the axis: the roles' time, the same for every endpoint, so
    that the roles of several endpoints (and of one) line up."""
    failed: int = 0
    first_error: str | None = None
    kept: dict[Key, None] = field(default_factory=dict)
    """The series admitted so far, in the order they came (`take`)."""
    per_name: dict[str, int] = field(default_factory=dict)
    dropped: dict[Key, None] = field(default_factory=dict)

    def take(self, tick: int, started: float, t: float, samples: dict[Key, _Sample]) -> None:
        """Keep a scrape's samples of the series admitted: a role's always, any other while
        its name has fewer than MAX_LABEL_SETS and the page fewer than MAX_SERIES. Decided as
        the pages come, so a page of thousands of series costs a long run no more memory
        than the series it keeps."""
        counted = [k for k, sample in samples.items() if sample.kind != "sum"]
        for key in counted:
            if key in self.kept or key in self.dropped:
                continue
            name = key[0]
            self.per_name[name] = self.per_name.get(name, 0) + 1
            role = any(_matches(known, key) for known in KNOWN)
            if role or (self.per_name[name] <= MAX_LABEL_SETS
                        and len(self.kept) < MAX_SERIES):
                self.kept[key] = None
            else:
                self.dropped[key] = None
        # A histogram's sum is read with its count, not as a series of its own.
        counts = {(samples[k].family, k[1]) for k in self.kept if k in samples
                  and samples[k].kind == "count"}
        self.scrapes.append((tick, t, {
            k: sample for k, sample in samples.items()
            if k in self.kept or (sample.kind == "sum" and (sample.family, k[1]) in counts)}))
        self.ticks[tick] = started


def _samples(page: list[tuple[str, str, dict, float]]) -> dict[Key, _Sample]:
    """The samples worth a series: gauges, counters, and the sums and counts of histograms
    and summaries (by family); buckets, quantiles, `_created` and info samples left out."""
    kept: dict[Key, _Sample] = {}
    for family_type, name, labels, value in page:
        if math.isnan(value) or name.endswith(("_created", "_bucket", "_gsum", "_gcount")):
            continue
        key = (name, tuple(sorted(labels.items())))
        if family_type in ("histogram", "summary"):
            if "quantile" in labels or not name.endswith(("_sum", "_count")):
                continue
            kept[key] = _Sample(name.rpartition("_")[2], name.rpartition("_")[0], value)
        elif family_type == "counter" or (family_type == "unknown" and name.endswith("_total")):
            kept[key] = _Sample("counter", name, value)
        elif family_type in ("gauge", "unknown"):
            kept[key] = _Sample("gauge", name, value)
    return kept


class PageScraper:
    """Scrapes `urls` every `interval_s` on a thread of its own (a slow page delays none of
    the sampler's readings), on the axis of the sampler that started at `t0_ns`."""

    def __init__(self, urls: Sequence[str], t0_ns: int,
                 interval_s: float = SCRAPE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._t0_ns = t0_ns
        self._endpoints = [_Endpoint(url) for url in dict.fromkeys(urls)]
        self._tick = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cadence-scrape", daemon=True)

    def start(self) -> PageScraper:
        self._thread.start()
        return self

    def _run(self) -> None:
        self.scrape_once()
        while not self._stop.wait(self.interval_s):
            self.scrape_once()

    def scrape_once(self) -> None:
        """One scrape of every endpoint, all under one tick (the roles add endpoints up by
        tick); a page that fails leaves a gap and counts as failed."""
        tick, self._tick = self._tick, self._tick + 1
        started = (time.monotonic_ns() - self._t0_ns) / 1e9
        for endpoint in self._endpoints:
            try:
                page = read_page(endpoint.url)
            except ScrapeError as exc:
                endpoint.failed += 1
                endpoint.first_error = endpoint.first_error or str(exc)
                continue
            t = (time.monotonic_ns() - self._t0_ns) / 1e9
            endpoint.take(tick, started, t, _samples(page))

    def stop(self) -> None:
        """Stop scraping, with one last scrape after the run."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.scrape_once()

    def result(self, window: tuple[float, float] | None) -> ScrapedMetrics:
        """The series and roles; `window` is the run's first send and last end on the axis
        (`run_window`), over which the roles' peaks and means are taken (every scrape's
        without one)."""
        return build(self._endpoints, self.interval_s, self._t0_ns, window)


def from_pages(pages: dict[str, list[tuple[float, str]]],
               window: tuple[float, float] | None = None,
               interval_s: float = SCRAPE_INTERVAL_S) -> ScrapedMetrics:
    """The series and roles of pages already read: for each URL, its texts and the time
    (on the run's axis) each was read, the k-th text of every URL one tick."""
    endpoints = []
    for url, texts in pages.items():
        endpoint = _Endpoint(url)
        for tick, (t, text) in enumerate(texts):
            endpoint.take(tick, t, t, _samples(parse_page(text)))
        endpoints.append(endpoint)
    return build(endpoints, interval_s, 0, window)


def build(endpoints: Sequence[_Endpoint], interval_s: float, t0_ns: int,
          window: tuple[float, float] | None) -> ScrapedMetrics:
    series: list[ScrapedSeries] = []
    found: list[ScrapedEndpoint] = []
    role_parts: dict[str, list[tuple[Known, _Endpoint, dict[int, tuple[float, float]]]]] = {}
    for endpoint in endpoints:
        roles = _roles_of(endpoint)
        for role, (known, points) in roles.items():
            role_parts.setdefault(role, []).append((known, endpoint, points))
        kept, dropped = list(endpoint.kept), list(endpoint.dropped)
        own = [one for key in kept for one in _series(endpoint, key)]
        series.extend(own)
        servers = sorted({known.server for known, _ in roles.values()})
        found.append(ScrapedEndpoint(
            url=endpoint.url, server=",".join(servers) or None, scrapes=len(endpoint.scrapes),
            failed_scrapes=endpoint.failed, first_error=endpoint.first_error,
            series=len(own), dropped_series=len(dropped),
            dropped=sorted({name for name, _ in dropped})[:20]))
    return ScrapedMetrics(
        interval_s=interval_s, started_ns=t0_ns,
        run_window_s=window, endpoints=found,
        roles={role: _role(role, role_parts[role], window) for role in ROLES
               if role in role_parts},
        series=series)


def _matches(known: Known, key: Key) -> bool:
    name, labels = key
    return name == known.name and set(known.labels) <= set(labels)


def _roles_of(endpoint: _Endpoint) -> dict[str, tuple[Known, dict[int, tuple[float, float]]]]:
    """{role: (the entry read, {tick: (t, value)})} of one endpoint: the first KNOWN entry of
    each role that the page has, its label sets combined; t when the page was read."""
    names = {k for _, _, samples in endpoint.scrapes for k in samples}
    roles: dict[str, tuple[Known, dict[int, tuple[float, float]]]] = {}
    for known in KNOWN:
        if known.role in roles or not any(_matches(known, k) for k in names):
            continue
        combine = max if known.role in _FULLEST else sum
        values: dict[int, tuple[float, float]] = {}
        for tick, t, samples in endpoint.scrapes:
            found = [s.value for k, s in samples.items() if _matches(known, k)]
            if found:
                values[tick] = (t, combine(found))
        if known.role == ROLE_PREEMPTED:
            values = _rates_by_tick(values)
        roles[known.role] = (known, values)
    return roles


def _rates_by_tick(values: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    ticks = sorted(values)
    return {b: (values[b][0], _rate(values[a], values[b])) for a, b in pairwise(ticks)
            if values[b][0] > values[a][0]}


def _rate(earlier: tuple[float, float], later: tuple[float, float]) -> float:
    """A counter's rate per second between two scrapes; a counter that went down restarted
    from zero (the server restarted), so its whole value is the growth, as Prometheus reads
    it."""
    (t0, v0), (t1, v1) = earlier, later
    growth = v1 - v0 if v1 >= v0 else v1
    return growth / (t1 - t0)


def _series(endpoint: _Endpoint, key: Key) -> list[ScrapedSeries]:
    """The series of one kept key: a gauge's values, a counter's rates, or a histogram's
    `_count` rates and the mean of each interval's observations."""
    name, labels = key
    points = [(tick, t, samples[key]) for tick, t, samples in endpoint.scrapes if key in samples]
    if not points:
        return []
    kind = points[0][2].kind
    if kind == "gauge":
        return [_one(endpoint.url, name, labels, "gauge", [(t, s.value) for _, t, s in points])]
    rates = [(t1, _rate((t0, s0.value), (t1, s1.value)))
             for (_, t0, s0), (_, t1, s1) in pairwise(points) if t1 > t0]
    out = [_one(endpoint.url, name, labels, "rate", rates)]
    if kind == "count":
        family = points[0][2].family
        sum_key = (f"{family}_sum", labels)
        sums = {tick: samples[sum_key].value for tick, _, samples in endpoint.scrapes
                if sum_key in samples}
        means = []
        for (tick0, _, c0), (tick1, t1, c1) in pairwise(points):
            counted = c1.value - c0.value
            if counted > 0 and tick0 in sums and tick1 in sums:
                means.append((t1, (sums[tick1] - sums[tick0]) / counted))
        out.append(_one(endpoint.url, family, labels, "mean", means))
    return out


def _one(url: str, name: str, labels: tuple[tuple[str, str], ...], kind: str,
         points: list[tuple[float, float]]) -> ScrapedSeries:
    return ScrapedSeries(url=url, name=name, labels=dict(labels), kind=kind,
                         points=thin(points, MAX_POINTS))


def thin(points: list, most: int) -> list:
    """At most `most` points, evenly spread, the first and last kept."""
    if len(points) <= most:
        return points
    step = (len(points) - 1) / (most - 1)
    return [points[round(i * step)] for i in range(most)]


def _role(role: str, parts: list[tuple[Known, _Endpoint, dict[int, tuple[float, float]]]],
          window: tuple[float, float] | None) -> ScrapedRole:
    """One role over every endpoint that has it: at each tick every endpoint has a value for,
    their sum (the fullest, for the KV cache); its peak and mean inside the run's window."""
    combine = max if role in _FULLEST else sum
    ticks = sorted(set.intersection(*(set(points) for _, _, points in parts)))
    points = [(parts[0][1].ticks[tick], combine(p[tick][1] for _, _, p in parts))
              for tick in ticks]
    inside = [v for t, v in points if window is None or window[0] <= t <= window[1]]
    return ScrapedRole(
        metric=", ".join(dict.fromkeys(_described(known) for known, _, _ in parts)),
        urls=[endpoint.url for _, endpoint, _ in parts],
        peak=max(inside) if inside else None,
        mean=sum(inside) / len(inside) if inside else None,
        points=thin(points, MAX_POINTS),
    )


def _described(known: Known) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in known.labels)
    return f"{known.name}{{{labels}}}" if labels else known.name


def run_window(records, t0_ns: int) -> tuple[float, float] | None:
    """The run on the sampler's axis: from the first request sent to the last one ended."""
    if not records:
        return None
    start = min(r.start_ns for r in records)
    end = max(max(r.end_ns, r.start_ns) for r in records)
    return (start - t0_ns) / 1e9, (end - t0_ns) / 1e9
