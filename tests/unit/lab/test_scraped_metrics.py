"""`cadence bench --scrape`: a foreign server's Prometheus pages turned into series and roles
(`cadence.lab.measure.prometheus`), the rules that read the roles (`server_queue_grows`,
`kv_cache_full`) and the rules that give way to them, the summary's lines and the report.

The pages are Prometheus text as vLLM, SGLang and Triton write it, parsed by
prometheus_client as a scrape would; the runs' records are built by hand as a load process
records them (tests/unit/lab/test_client_side_diagnosis.py)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.analysis.stats import summarize
from cadence.lab.measure.prometheus import (
    MAX_LABEL_SETS,
    MAX_SERIES,
    ScrapeError,
    from_pages,
    parse_page,
)
from cadence.lab.report.run import render_report
from cadence.lab.report.summary import scraped_lines
from cadence.lab.results import BenchResult, ScrapedMetrics, to_builtins
from tests.unit.lab.test_client_side_diagnosis import MS, burst

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="m"}} {preempted}
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{{engine="0",model_name="m"}} 1.7e9
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens}
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="1.0",model_name="m"}} {done}
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {done}
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} {done}
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="m"}} {latency_sum}
"""


def vllm_page(
    running: float,
    waiting: float,
    kv: float = 0.3,
    preempted: float = 0,
    tokens: float = 0,
    done: float = 0,
    latency_sum: float = 0,
) -> str:
    return VLLM.format(
        running=running,
        waiting=waiting,
        kv=kv,
        preempted=preempted,
        tokens=tokens,
        done=done,
        latency_sum=latency_sum,
    )


def scraped(
    pages: list[str],
    url: str = "http://vllm:8000/metrics",
    window: tuple[float, float] | None = None,
) -> ScrapedMetrics:
    """Pages read every 0.5 s from 0."""
    return from_pages({url: [(0.5 * k, text) for k, text in enumerate(pages)]}, window)


def series(result: ScrapedMetrics, name: str, kind: str):
    return next(s for s in result.series if s.name == name and s.kind == kind)


def test_gauges_as_values_counters_as_rates_histograms_as_rate_and_mean() -> None:
    pages = [vllm_page(8, 0, tokens=100 * k, done=2 * k, latency_sum=3.0 * k) for k in range(5)]
    result = scraped(pages)
    assert series(result, "vllm:num_requests_running", "gauge").points == [
        (0.5 * k, 8.0) for k in range(5)
    ]
    assert series(result, "vllm:num_requests_running", "gauge").labels == {
        "engine": "0",
        "model_name": "m",
    }
    # 100 tokens every 0.5 s: 200 per second, at the end of each interval
    assert series(result, "vllm:generation_tokens_total", "rate").points == [
        (0.5 * k, 200.0) for k in range(1, 5)
    ]
    assert series(result, "vllm:e2e_request_latency_seconds_count", "rate").points[0] == (0.5, 4.0)
    # 2 requests in each interval, 3 s of latency between them: 1.5 s each
    assert series(result, "vllm:e2e_request_latency_seconds", "mean").points == [
        (0.5 * k, 1.5) for k in range(1, 5)
    ]
    names = {s.name for s in result.series}
    assert not any(n.endswith(("_bucket", "_created", "_sum")) for n in names)
    assert result.endpoints[0].server == "vllm" and result.endpoints[0].scrapes == 5


def test_a_counter_that_restarts_counts_from_zero() -> None:
    pages = [vllm_page(1, 0, tokens=t) for t in (1000, 1100, 50)]
    assert [
        v for _, v in series(scraped(pages), "vllm:generation_tokens_total", "rate").points
    ] == [200.0, 100.0]


def test_roles_of_vllm_with_peak_and_mean_over_the_run_window() -> None:
    pages = [vllm_page(k, 10 * k, kv=0.1 * k, preempted=k * k) for k in range(6)]
    result = scraped(pages, window=(1.0, 2.0))
    roles = result.roles
    assert set(roles) == {"running", "waiting", "kv_cache_use", "preempted"}
    assert roles["running"].metric == "vllm:num_requests_running"
    assert roles["waiting"].points[-1] == (2.5, 50.0)
    # inside 1.0-2.0 s: the scrapes at 1.0, 1.5 and 2.0
    assert roles["waiting"].peak == 40.0 and roles["waiting"].mean == 30.0
    assert roles["kv_cache_use"].peak == pytest.approx(0.4)
    # preemptions 0, 1, 4, 9, 16, 25: per second over each 0.5 s
    assert [v for _, v in roles["preempted"].points] == [2.0, 6.0, 10.0, 14.0, 18.0]


def test_roles_add_label_sets_and_endpoints_the_kv_cache_at_its_fullest() -> None:
    sglang = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{tp_rank="0"}} {r}
sglang:num_running_reqs{{tp_rank="1"}} {r}
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{tp_rank="0"}} 2
# TYPE sglang:token_usage gauge
sglang:token_usage{{tp_rank="0"}} 0.5
sglang:token_usage{{tp_rank="1"}} {kv}
"""
    result = from_pages(
        {
            "http://a/metrics": [
                (0.0, sglang.format(r=3, kv=0.7)),
                (0.5, sglang.format(r=4, kv=0.9)),
            ],
            "http://b/metrics": [(0.1, vllm_page(5, 1, kv=0.2)), (0.6, vllm_page(5, 1, kv=0.95))],
        }
    )
    assert [e.server for e in result.endpoints] == ["sglang", "vllm"]
    # the roles' points are the ticks' times, one for both endpoints
    assert result.roles["running"].points == [(0.0, 11.0), (0.5, 13.0)]
    assert result.roles["waiting"].points == [(0.0, 3.0), (0.5, 3.0)]
    assert result.roles["kv_cache_use"].points == [(0.0, 0.7), (0.5, 0.95)]
    assert result.roles["running"].urls == ["http://a/metrics", "http://b/metrics"]


def test_triton_reads_its_tensorrt_llm_queue_once_not_twice() -> None:
    triton = """# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 8
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 5
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 13
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.25
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 120
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="ensemble",version="1"} 5
"""
    roles = scraped([triton, triton], url="http://triton:8002/metrics").roles
    assert roles["running"].peak == 8 and roles["waiting"].peak == 5
    assert roles["waiting"].metric == 'nv_trt_llm_request_metrics{request_type="waiting"}'
    assert roles["kv_cache_use"].peak == 0.25


def test_cadence_own_page_gives_the_running_batch() -> None:
    page = """# TYPE cadence_worker_batch_size gauge
cadence_worker_batch_size{worker="0"} 6
cadence_worker_batch_size{worker="1"} 7
# TYPE cadence_active_streams gauge
cadence_active_streams 20
"""
    result = scraped([page, page], url="http://127.0.0.1:9100/metrics")
    assert result.endpoints[0].server == "cadence"
    assert set(result.roles) == {"running"} and result.roles["running"].peak == 13


def test_label_sets_over_the_cap_are_dropped_with_a_note() -> None:
    lines = ["# TYPE per_adapter gauge"] + [f'per_adapter{{adapter="a{k}"}} {k}' for k in range(20)]
    result = scraped(["\n".join(lines) + "\n"] * 2, url="http://x/metrics")
    assert len(result.series) == MAX_LABEL_SETS
    endpoint = result.endpoints[0]
    assert endpoint.dropped_series == 20 - MAX_LABEL_SETS and endpoint.dropped == ["per_adapter"]
    assert endpoint.server is None and result.roles == {}


def test_series_over_the_cap_are_dropped_but_never_a_role_s() -> None:
    many = "".join(f"# TYPE g{k} gauge\ng{k} {k}\n" for k in range(100))
    result = scraped([many + vllm_page(8, 3)] * 2)
    endpoint = result.endpoints[0]
    roles = 4  # running, waiting, KV cache, preemptions: after the cap, kept all the same
    assert endpoint.series == MAX_SERIES + roles and endpoint.dropped_series > 100 - MAX_SERIES
    assert set(result.roles) == {"running", "waiting", "kv_cache_use", "preempted"}


def test_a_page_that_is_not_prometheus_text_is_one_line() -> None:
    with pytest.raises(ScrapeError, match="not a Prometheus metrics page"):
        parse_page("<html><body>Not found</body></html>")


# -- the rules ------------------------------------------------------------------------------


def with_roles(pages: list[str], records=None) -> BenchResult:
    """A run whose records (default: 16 plain streams) span 0-5 s of the scrapes' axis."""
    records = records if records is not None else burst(16)
    result = BenchResult(**msgspec.structs.asdict(summarize(records)))
    result.records = records
    result.scraped = scraped(pages, window=(0.0, 0.5 * (len(pages) - 1)))
    return result


def fired(result: BenchResult) -> dict:
    return {f.rule: f for f in diagnose(result)}


def test_a_queue_behind_a_full_batch_is_named() -> None:
    pages = [vllm_page(8, 24) for _ in range(10)]
    found = fired(with_roles(pages))
    finding = found["server_queue_grows"]
    assert (
        "held 24 on average" in finding.finding and "stayed at their largest, 8" in finding.finding
    )
    assert finding.evidence["running_max"] == 8 and finding.evidence["waiting_peak"] == 24
    assert "vllm:num_requests_waiting" in finding.evidence["metrics"]
    assert "--max-num-seqs" in finding.look_at
    assert "kv_cache_full" not in found


def test_a_growing_queue_says_so() -> None:
    pages = [vllm_page(8, 2 + 4 * k) for k in range(12)]
    finding = fired(with_roles(pages))["server_queue_grows"]
    assert finding.finding.startswith("the server's own queue grew from")


@pytest.mark.parametrize(
    "pages",
    [
        [vllm_page(8, 0)] * 10,  # no queue
        [vllm_page(8, 3 if k in (2, 7) else 0) for k in range(10)],  # a request now and then
        [vllm_page(k + 1, 4) for k in range(10)],  # the batch still filling while some wait
    ],
)
def test_silent_without_a_queue_behind_a_full_batch(pages: list[str]) -> None:
    assert "server_queue_grows" not in fired(with_roles(pages))


def test_a_queue_outside_the_run_is_not_the_run_s() -> None:
    pages = [vllm_page(8, 0)] * 6 + [vllm_page(8, 30)] * 6
    result = with_roles(pages)
    result.scraped.run_window_s = (0.0, 2.5)  # the run ended before the queue built up
    assert "server_queue_grows" not in fired(result)


def test_a_full_kv_cache_with_requests_waiting_is_named_before_the_batch_limit() -> None:
    pages = [vllm_page(6, 10, kv=0.97, preempted=k) for k in range(10)]
    found = fired(with_roles(pages))
    finding = found["kv_cache_full"]
    assert "97% in use" in finding.finding and "preempted up to 2.0" in finding.finding
    assert finding.evidence["kv_cache_use_peak"] == 0.97
    assert "--gpu-memory-utilization" in finding.look_at
    # The batch sits at its largest because the cache is full: the cache is named alone.
    assert "server_queue_grows" not in found


def test_a_full_kv_cache_without_a_queue_is_a_well_used_cache() -> None:
    assert "kv_cache_full" not in fired(with_roles([vllm_page(6, 0, kv=0.97)] * 10))


def test_client_side_rules_give_way_to_the_server_s_queue() -> None:
    """An even, long first-token wait in a closed loop reads as a fixed cost per request
    from the client's side; the server's metrics show it is the queue."""
    records = burst(32, ttft=lambda k: 400 * MS)
    assert set(fired(with_roles([vllm_page(8, 0)] * 4, records))) == {"slow_first_message"}
    found = fired(with_roles([vllm_page(8, 24)] * 4, records))
    assert "server_queue_grows" in found and "slow_first_message" not in found
    capped = burst(16, ttft=lambda k: 25 * MS + (k // 4) * 50 * 20 * MS)
    assert "ttft_grows_with_streams" in fired(with_roles([vllm_page(4, 0)] * 4, capped))
    found = fired(with_roles([vllm_page(4, 12)] * 4, capped))
    assert "server_queue_grows" in found and "ttft_grows_with_streams" not in found


# -- the summary, the report, the JSON -------------------------------------------------------


@pytest.mark.slow
def test_summary_lines_report_and_json(tmp_path: Path) -> None:
    pages = [vllm_page(8, 24, kv=0.5, tokens=100 * k) for k in range(10)]
    result = with_roles(pages)
    result.scraped.endpoints[0].failed_scrapes = 2
    result.scraped.endpoints[0].first_error = "timed out"
    lines = scraped_lines(result.scraped)
    assert lines[0].startswith("scraped http://vllm:8000/metrics (vllm): 10 scrapes, ")
    assert "2 failed (first: timed out)" in lines[0]
    assert lines[1] == (
        "the server's own metrics over the run: requests running peak 8 (mean "
        "8), waiting peak 24 (mean 24), KV cache in use peak 50% (mean 50%), "
        "preempted peak 0.0/s (mean 0.0/s)"
    )
    result.diagnosis = diagnose(result)
    page = render_report(result, tmp_path).read_text()
    assert "The server&#x27;s own metrics (--scrape)" in page or "own metrics (--scrape)" in page
    assert (tmp_path / "server_metrics.png").exists()
    written = to_builtins(result)
    assert set(written["scraped"]) == {
        "interval_s",
        "started_ns",
        "run_window_s",
        "endpoints",
        "roles",
        "series",
    }
    again = msgspec.convert(json.loads(json.dumps(written)), BenchResult)
    assert again.scraped.roles["waiting"].peak == 24


def test_a_page_without_known_names_is_plotted_by_its_changing_series(tmp_path: Path) -> None:
    pages = [
        f"# TYPE queue_depth gauge\nqueue_depth {k}\n# TYPE up gauge\nup 1\n" for k in range(5)
    ]
    result = with_roles(pages)
    render_report(result, tmp_path)
    assert (tmp_path / "server_metrics.png").exists()
    assert scraped_lines(result.scraped) == [
        "scraped http://vllm:8000/metrics (no names of a known server): 5 scrapes, 2 series"
    ]


def _cache_page(prefix: str, label: str, counts: dict[str, tuple[int, int]]) -> str:
    """A page of prefix-cache counters: {label value: (hits, queries)}."""
    lines = []
    for kind, at in (("hits", 0), ("queries", 1)):
        lines.append(f"# TYPE {prefix}prefix_cache_{kind} counter")
        lines += [
            f'{prefix}prefix_cache_{kind}_total{{{label}="{v}"}} {c[at]}' for v, c in counts.items()
        ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("prefix, label", [("cadence_", "worker"), ("vllm:", "engine")])
def test_prefix_cache_hit_rate_by_worker(prefix, label) -> None:
    """cadence's counters by worker and vLLM's by engine: each label set's hit rate over the
    scrapes, from the counters' growth (the tokens before the first scrape not counted)."""
    pages = [
        (0.0, {"0": (5, 10), "1": (0, 0)}),
        (0.5, {"0": (15, 110), "1": (0, 40)}),
        (1.0, {"0": (65, 210), "1": (30, 80)}),
    ]
    scraped = from_pages(
        {"http://x/metrics": [(t, _cache_page(prefix, label, c)) for t, c in pages]}
    )
    [w0, w1] = scraped.prefix_cache
    assert (w0.labels, w0.hit_tokens, w0.query_tokens) == ({label: "0"}, 60, 200)
    assert w0.hit_rate == pytest.approx(0.3) and w1.hit_rate == pytest.approx(30 / 80)
    assert w0.metric == f"{prefix}prefix_cache_hits_total"
    assert not from_pages({"http://x/metrics": [(0.0, "a 1\n"), (0.5, "a 2\n")]}).prefix_cache
