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

import functools
import http.client
import io
import math
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

from cadence.lab.results import (
    PrefixCacheHits,
    ScrapedEndpoint,
    ScrapedMetrics,
    ScrapedRole,
    ScrapedSeries,
)

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
SCRAPE_DEADLINE_S = 5.0
"""The whole of one scrape, connecting, reading and parsing: a page that trickles in or
takes longer to parse fails at this point, not when its last byte comes (a socket timeout
alone lets a page sending a byte a second hold the bench for ever). Pages of a few hundred
series take milliseconds."""
MAX_PAGE_BYTES = 16 * 2**20
"""The most of one page read: vLLM's, SGLang's or Triton's with many models are well under a
megabyte, and parsing one costs about half a second per megabyte and, for one metric of
many label sets, up to 25 times its size in memory while it is parsed."""
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
    Known("cadence_worker_batch_size", ROLE_RUNNING, "cadence"),
    Known("vllm:num_requests_running", ROLE_RUNNING, "vllm"),
    Known("vllm:num_requests_waiting", ROLE_WAITING, "vllm"),
    Known("vllm:kv_cache_usage_perc", ROLE_KV_CACHE_USE, "vllm"),
    Known("vllm:gpu_cache_usage_perc", ROLE_KV_CACHE_USE, "vllm"),
    Known("vllm:num_preemptions_total", ROLE_PREEMPTED, "vllm"),
    Known("sglang:num_running_reqs", ROLE_RUNNING, "sglang"),
    Known("sglang:num_queue_reqs", ROLE_WAITING, "sglang"),
    Known("sglang:token_usage", ROLE_KV_CACHE_USE, "sglang"),
    Known("nv_trt_llm_request_metrics", ROLE_RUNNING, "triton", (("request_type", "scheduled"),)),
    Known("nv_trt_llm_request_metrics", ROLE_WAITING, "triton", (("request_type", "waiting"),)),
    Known(
        "nv_trt_llm_kv_cache_block_metrics",
        ROLE_KV_CACHE_USE,
        "triton",
        (("kv_cache_block_type", "fraction"),),
    ),
    Known("nv_inference_pending_request_count", ROLE_WAITING, "triton"),
    Known("trtllm_num_requests_running", ROLE_RUNNING, "tensorrt-llm"),
    Known("trtllm_num_requests_waiting", ROLE_WAITING, "tensorrt-llm"),
    Known("trtllm_kv_cache_utilization", ROLE_KV_CACHE_USE, "tensorrt-llm"),
)
"""For each role, the first of its entries that a page has is the one read (a Triton server
with the TensorRT-LLM backend has both its own queue and Triton's, which would count the same
requests twice); its label sets are added up (models, data-parallel engines, workers), the KV
cache's taken at their fullest. The vLLM, SGLang and TensorRT-LLM KV gauges are fractions
(vLLM's `_perc` too). Plain Triton exports no gauge of running requests (its
`nv_inference_exec_count` counts executions), so only its queue has a role. cadence exports
its queue and KV use under vLLM's names too (for inference gateways): on a page with cadence's
own metrics those are read as cadence's."""

_FULLEST = (ROLE_KV_CACHE_USE,)
"""Roles whose label sets (and endpoints) are combined by their largest value, not a sum: the
fullest cache is the one that stops admissions."""


class ScrapeError(RuntimeError):
    """A page that could not be read or is not a Prometheus page."""


class ScrapeBound(ScrapeError):
    """A page over MAX_PAGE_BYTES or not had within SCRAPE_DEADLINE_S: the run stops reading
    it (each later scrape would cost the same again)."""


def read_page(
    url: str, deadline_s: float | None = None, max_bytes: int | None = None
) -> list[tuple[str, str, dict, float]]:
    """Every sample of the page at `url` as (family type, sample name, labels, value), within
    `deadline_s` (SCRAPE_DEADLINE_S) and `max_bytes` (MAX_PAGE_BYTES); raises ScrapeError,
    worded for one line, when it cannot be had (ScrapeBound when a bound was hit)."""
    deadline_s = SCRAPE_DEADLINE_S if deadline_s is None else deadline_s
    deadline = time.monotonic() + deadline_s
    return list(_parsed(fetch_page(url, deadline_s, max_bytes), deadline, deadline_s))


def fetch_page(url: str, deadline_s: float | None = None, max_bytes: int | None = None) -> str:
    """The text of the page at `url`, read whole within `deadline_s` and `max_bytes` (the
    module's defaults when None); raises ScrapeError as `read_page` does."""
    import urllib.error
    import urllib.request

    deadline_s = SCRAPE_DEADLINE_S if deadline_s is None else deadline_s
    max_bytes = MAX_PAGE_BYTES if max_bytes is None else max_bytes
    watch = _Watch()
    opener = urllib.request.build_opener(*(handler(watch) for handler in _handlers()))
    timer = threading.Timer(deadline_s, watch.fire)
    timer.daemon = True
    timer.start()
    body = bytearray()
    try:
        with opener.open(url, timeout=deadline_s) as reply:
            declared = reply.length
            if declared is not None and declared > max_bytes:
                raise _over(max_bytes, f"it declares {_mib(declared)}")
            while chunk := reply.read1(_CHUNK):
                body += chunk
                if len(body) > max_bytes:
                    raise _over(max_bytes, "")
    except ScrapeError:
        raise
    except urllib.error.HTTPError as exc:
        raise ScrapeError(f"HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        if watch.fired or isinstance(exc.reason, TimeoutError):
            raise _late(deadline_s, len(body)) from None
        raise ScrapeError(str(exc.reason)) from None
    except Exception as exc:
        # Cutting the socket mid-read surfaces as whatever the reader was doing then; the
        # socket's own timeout (the same deadline, per read) may come first.
        if watch.fired or isinstance(exc, TimeoutError):
            raise _late(deadline_s, len(body)) from None
        if not isinstance(exc, (OSError, http.client.HTTPException, ValueError)):
            raise
        raise ScrapeError(f"{type(exc).__name__}: {exc}") from None
    finally:
        timer.cancel()
    if watch.fired:  # a body read until the cut socket ended it is not the whole page
        raise _late(deadline_s, len(body))
    return body.decode("utf-8", errors="replace")


_CHUNK = 1 << 16


def _mib(n: float) -> str:
    return f"{n / 2**20:.3g} MiB"


def _over(max_bytes: int, how: str) -> ScrapeBound:
    return ScrapeBound(
        f"the page is larger than {_mib(max_bytes)}, the most read of one page"
        + (f" ({how})" if how else "")
    )


def _late(deadline_s: float, got: int) -> ScrapeBound:
    return ScrapeBound(
        f"the page was not read within {deadline_s:g} s, the limit of one "
        f"scrape ({got} bytes of it had come)"
    )


class _Watch:
    """Cuts the sockets of one fetch when its deadline passes (`fire`, on a timer's thread):
    a blocked read then ends at once, however slowly the server sends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        """Each connection's socket as connected: urllib drops the connection's own reference
        to it while the response is still read through it."""
        self.fired = False

    def watched(self, connection: http.client.HTTPConnection) -> http.client.HTTPConnection:
        connect = connection.connect

        def connected() -> None:
            connect()
            with self._lock:
                self._sockets.append(connection.sock)
                if self.fired:  # the deadline passed while it connected
                    _cut(connection.sock)

        # Wraps this one connection's connect (an instance attribute over the method).
        connection.connect = connected  # type: ignore[method-assign]
        return connection

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            for sock in self._sockets:
                _cut(sock)


def _cut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):
        pass  # already closed, or a TLS socket mid-handshake


class _WatchedHandler:
    """urllib's handler of one scheme, its connections handed to a `_Watch`."""

    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self._watch = watch

    def do_open(self, http_class, req, **kwargs):
        watch = self._watch
        return super().do_open(
            lambda host, **kw: watch.watched(http_class(host, **kw)), req, **kwargs
        )


@functools.cache
def _handlers() -> tuple[type, type]:
    """urllib's HTTP and HTTPS handlers with their connections watched (made on first use:
    urllib.request is imported only by a bench that scrapes)."""
    import urllib.request

    class HTTP(_WatchedHandler, urllib.request.HTTPHandler):
        pass

    class HTTPS(_WatchedHandler, urllib.request.HTTPSHandler):
        pass

    return HTTP, HTTPS


def parse_page(text: str) -> list[tuple[str, str, dict, float]]:
    """Every sample of a page's text (see `read_page`); raises ScrapeError when it is not in
    the Prometheus text format."""
    return list(_parsed(text))


def _parsed(
    text: str, deadline: float | None = None, deadline_s: float = 0.0
) -> Iterator[tuple[str, str, dict, float]]:
    """The samples of `text` as they are parsed (a family at a time, so a large page is
    never held as samples all at once); past `deadline` (monotonic) raises ScrapeBound."""
    from prometheus_client.parser import text_fd_to_metric_families

    def lines() -> Iterator[str]:
        for n, line in enumerate(io.StringIO(text)):
            # Checked as lines are read: one family can fill the whole page.
            if deadline is not None and n % 1024 == 0 and time.monotonic() > deadline:
                raise ScrapeBound(
                    f"the page was not read and parsed within {deadline_s:g} "
                    f"s, the limit of one scrape ({_mib(len(text))} of text)"
                )
            yield line

    try:
        # The parser is typed TextIO but only iterates it: a generator of lines does.
        for family in text_fd_to_metric_families(lines()):  # type: ignore[arg-type]
            for s in family.samples:
                yield family.type, s.name, s.labels, float(s.value)
    except (ValueError, TypeError, IndexError) as exc:
        head = text.lstrip()[:200]
        first = head.splitlines()[0][:60] if head else ""
        raise ScrapeError(
            f"not a Prometheus metrics page ({str(exc)[:80]}; it begins {first!r})"
        ) from None


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
    dropped: set[int] = field(default_factory=set)
    """The hashes of the series left out: a page of a hundred thousand series would
    otherwise hold as many keys for as long as the run, only to count them."""
    dropped_names: set[str] = field(default_factory=set)
    stopped: str | None = None
    """Why the page is no longer read (a ScrapeBound); None while it is."""

    def take(
        self, tick: int, started: float, t: float, samples: Iterable[tuple[Key, _Sample]]
    ) -> None:
        """Keep a scrape's samples of the series admitted: a role's always, any other while
        its name has fewer than MAX_LABEL_SETS and the page fewer than MAX_SERIES. Decided as
        the samples come, so a page of thousands of series costs a long run, or the scrape
        itself, no more memory than the series it keeps. A page that fails part way keeps
        nothing of that scrape (the series it admitted stay admitted)."""
        kept: dict[Key, _Sample] = {}
        sums: dict[Key, _Sample] = {}
        for key, sample in samples:
            if sample.kind == "sum":
                # A histogram's sum is read with its count, not as a series of its own; the
                # page may give it before its count.
                sums[key] = sample
                continue
            if key not in self.kept and hash(key) not in self.dropped:
                name = key[0]
                self.per_name[name] = self.per_name.get(name, 0) + 1
                role = any(_matches(known, key) for known in KNOWN)
                if role or (self.per_name[name] <= MAX_LABEL_SETS and len(self.kept) < MAX_SERIES):
                    self.kept[key] = None
                else:
                    self.dropped.add(hash(key))
                    self.dropped_names.add(name)
            if key in self.kept:
                kept[key] = sample
        counts = {(sample.family, k[1]) for k, sample in kept.items() if sample.kind == "count"}
        kept.update((k, sample) for k, sample in sums.items() if (sample.family, k[1]) in counts)
        self.scrapes.append((tick, t, kept))
        self.ticks[tick] = started


def _samples(page: Iterable[tuple[str, str, dict, float]]) -> Iterator[tuple[Key, _Sample]]:
    """The samples worth a series: gauges, counters, and the sums and counts of histograms
    and summaries (by family); buckets, quantiles, `_created` and info samples left out."""
    for family_type, name, labels, value in page:
        if math.isnan(value) or name.endswith(("_created", "_bucket", "_gsum", "_gcount")):
            continue
        key = (name, tuple(sorted(labels.items())))
        if family_type in ("histogram", "summary"):
            if "quantile" in labels or not name.endswith(("_sum", "_count")):
                continue
            yield key, _Sample(name.rpartition("_")[2], name.rpartition("_")[0], value)
        elif family_type == "counter" or (family_type == "unknown" and name.endswith("_total")):
            yield key, _Sample("counter", name, value)
        elif family_type in ("gauge", "unknown"):
            yield key, _Sample("gauge", name, value)


class PageScraper:
    """Scrapes `urls` every `interval_s` on a thread of its own (a slow page delays none of
    the sampler's readings), on the axis of the sampler that started at `t0_ns`."""

    def __init__(
        self,
        urls: Sequence[str],
        t0_ns: int,
        interval_s: float = SCRAPE_INTERVAL_S,
        deadline_s: float | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.interval_s = interval_s
        self._t0_ns = t0_ns
        self._deadline_s = SCRAPE_DEADLINE_S if deadline_s is None else deadline_s
        self._max_bytes = max_bytes
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
        tick); a page that fails leaves a gap and counts as failed, and one that hits a
        bound (ScrapeBound) is read no more."""
        tick, self._tick = self._tick, self._tick + 1
        started = (time.monotonic_ns() - self._t0_ns) / 1e9
        for endpoint in self._endpoints:
            if endpoint.stopped is not None:
                continue
            deadline = time.monotonic() + self._deadline_s
            try:
                text = fetch_page(endpoint.url, self._deadline_s, self._max_bytes)
                t = (time.monotonic_ns() - self._t0_ns) / 1e9
                endpoint.take(tick, started, t, _samples(_parsed(text, deadline, self._deadline_s)))
            except ScrapeError as exc:
                endpoint.failed += 1
                endpoint.first_error = endpoint.first_error or str(exc)
                if isinstance(exc, ScrapeBound):
                    endpoint.stopped = str(exc)

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


def from_pages(
    pages: dict[str, list[tuple[float, str]]],
    window: tuple[float, float] | None = None,
    interval_s: float = SCRAPE_INTERVAL_S,
) -> ScrapedMetrics:
    """The series and roles of pages already read: for each URL, its texts and the time
    (on the run's axis) each was read, the k-th text of every URL one tick."""
    endpoints = []
    for url, texts in pages.items():
        endpoint = _Endpoint(url)
        for tick, (t, text) in enumerate(texts):
            endpoint.take(tick, t, t, _samples(parse_page(text)))
        endpoints.append(endpoint)
    return build(endpoints, interval_s, 0, window)


def build(
    endpoints: Sequence[_Endpoint],
    interval_s: float,
    t0_ns: int,
    window: tuple[float, float] | None,
) -> ScrapedMetrics:
    series: list[ScrapedSeries] = []
    found: list[ScrapedEndpoint] = []
    role_parts: dict[str, list[tuple[Known, _Endpoint, dict[int, tuple[float, float]]]]] = {}
    for endpoint in endpoints:
        roles = _roles_of(endpoint)
        for role, (known, points) in roles.items():
            role_parts.setdefault(role, []).append((known, endpoint, points))
        kept = list(endpoint.kept)
        own = [one for key in kept for one in _series(endpoint, key)]
        series.extend(own)
        servers = sorted({known.server for known, _ in roles.values()})
        found.append(
            ScrapedEndpoint(
                url=endpoint.url,
                server=",".join(servers) or None,
                scrapes=len(endpoint.scrapes),
                failed_scrapes=endpoint.failed,
                first_error=endpoint.first_error,
                stopped=endpoint.stopped,
                series=len(own),
                dropped_series=len(endpoint.dropped),
                dropped=sorted(endpoint.dropped_names)[:20],
            )
        )
    scraped = ScrapedMetrics(
        interval_s=interval_s,
        started_ns=t0_ns,
        run_window_s=window,
        endpoints=found,
        roles={role: _role(role, role_parts[role], window) for role in ROLES if role in role_parts},
        series=series,
    )
    hits = prefix_cache_hits(endpoints)
    if hits:
        scraped.prefix_cache = hits
    return scraped


PREFIX_CACHE_COUNTERS = (
    ("cadence_prefix_cache_hits_total", "cadence_prefix_cache_queries_total"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
)
"""(hits, queries) counter pairs of prompt tokens found in a prefix cache and looked up in
it: cadence's (labelled by worker) and vLLM's (by engine and model)."""
_CACHE_SUFFIXES = tuple({name for pair in PREFIX_CACHE_COUNTERS for name in pair})


def prefix_cache_hits(endpoints: Sequence[_Endpoint]) -> list[PrefixCacheHits]:
    """Each label set's prefix-cache hit rate over the scrapes: the growth of the counters
    (`PREFIX_CACHE_COUNTERS`) from the first scrape to the last, interval by interval (a
    counter that went down restarted from zero)."""
    found = []
    for endpoint in endpoints:
        growth: dict[Key, float] = {}
        last: dict[Key, float] = {}
        for _, _, samples in endpoint.scrapes:
            for key, sample in samples.items():
                if not key[0].endswith(_CACHE_SUFFIXES):
                    continue
                if key in last:
                    growth[key] = growth.get(key, 0.0) + _growth(last[key], sample.value)
                last[key] = sample.value
        for (name, labels), got in growth.items():
            for hits, queries in PREFIX_CACHE_COUNTERS:
                if name == hits:
                    asked = growth.get((queries, labels), 0.0)
                    found.append(
                        PrefixCacheHits(
                            url=endpoint.url,
                            labels=dict(labels),
                            metric=name,
                            query_tokens=asked,
                            hit_tokens=got,
                            hit_rate=got / asked if asked else None,
                        )
                    )
    return sorted(found, key=lambda h: (h.url, sorted(h.labels.items())))


def _matches(known: Known, key: Key) -> bool:
    name, labels = key
    return name == known.name and set(known.labels) <= set(labels)


def _roles_of(endpoint: _Endpoint) -> dict[str, tuple[Known, dict[int, tuple[float, float]]]]:
    """{role: (the entry read, {tick: (t, value)})} of one endpoint: the first KNOWN entry of
    each role that the page has, its label sets combined; t when the page was read."""
    names = {k for _, _, samples in endpoint.scrapes for k in samples}
    cadence = any(name.startswith("cadence_") for name, _ in names)
    roles: dict[str, tuple[Known, dict[int, tuple[float, float]]]] = {}
    for known in KNOWN:
        if known.role in roles or not any(_matches(known, k) for k in names):
            continue
        if cadence and known.server == "vllm":
            known = replace(known, server="cadence")
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
    return {
        b: (values[b][0], _rate(values[a], values[b]))
        for a, b in pairwise(ticks)
        if values[b][0] > values[a][0]
    }


def _rate(earlier: tuple[float, float], later: tuple[float, float]) -> float:
    """A counter's rate per second between two scrapes."""
    (t0, v0), (t1, v1) = earlier, later
    return _growth(v0, v1) / (t1 - t0)


def _growth(v0: float, v1: float) -> float:
    """A counter's growth between two scrapes; one that went down restarted from zero (the
    server restarted), so its whole value is the growth, as Prometheus reads it."""
    return v1 - v0 if v1 >= v0 else v1


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
    rates = [
        (t1, _rate((t0, s0.value), (t1, s1.value)))
        for (_, t0, s0), (_, t1, s1) in pairwise(points)
        if t1 > t0
    ]
    out = [_one(endpoint.url, name, labels, "rate", rates)]
    if kind == "count":
        family = points[0][2].family
        sum_key = (f"{family}_sum", labels)
        sums = {
            tick: samples[sum_key].value
            for tick, _, samples in endpoint.scrapes
            if sum_key in samples
        }
        means = []
        for (tick0, _, c0), (tick1, t1, c1) in pairwise(points):
            counted = c1.value - c0.value
            if counted > 0 and tick0 in sums and tick1 in sums:
                means.append((t1, (sums[tick1] - sums[tick0]) / counted))
        out.append(_one(endpoint.url, family, labels, "mean", means))
    return out


def _one(
    url: str,
    name: str,
    labels: tuple[tuple[str, str], ...],
    kind: str,
    points: list[tuple[float, float]],
) -> ScrapedSeries:
    return ScrapedSeries(
        url=url, name=name, labels=dict(labels), kind=kind, points=thin(points, MAX_POINTS)
    )


def thin(points: list, most: int) -> list:
    """At most `most` points, evenly spread, the first and last kept."""
    if len(points) <= most:
        return points
    step = (len(points) - 1) / (most - 1)
    return [points[round(i * step)] for i in range(most)]


def _role(
    role: str,
    parts: list[tuple[Known, _Endpoint, dict[int, tuple[float, float]]]],
    window: tuple[float, float] | None,
) -> ScrapedRole:
    """One role over every endpoint that has it: at each tick every endpoint has a value for,
    their sum (the fullest, for the KV cache); its peak and mean inside the run's window."""
    combine = max if role in _FULLEST else sum
    ticks = sorted(set.intersection(*(set(points) for _, _, points in parts)))
    points = [(parts[0][1].ticks[tick], combine(p[tick][1] for _, _, p in parts)) for tick in ticks]
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
