"""The gauges an inference gateway's endpoint picker reads, under vLLM's names, scraped from a
loaded server: they are gauges with vLLM's `model_name` label, and they move as cadence's
queue does (requests waiting for a place in a step, requests in steps, KV cache held); the
per-worker batch size falls back to 0 once the worker is idle."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cadence.client import Client
from tests.integration.conftest import RunningServer, start_server

GATEWAY = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def _scrape(url: str) -> dict[str, tuple[str, dict[tuple, float]]]:
    """{family: (type, {labels: value})}."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        f.name: (f.type, {tuple(sorted(s.labels.items())): s.value for s in f.samples})
        for f in text_string_to_metric_families(text)
    }


def _serve(*args: str) -> tuple[RunningServer, str]:
    """A server exporting metrics on a free port, and its metrics page's URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server("--host", "127.0.0.1", "--metrics-port", str(port), *args)
    return server, f"http://127.0.0.1:{port}/metrics"


def _gauge(page: dict, name: str, **labels: str) -> float:
    kind, samples = page[name]
    assert kind == "gauge"
    return samples[tuple(sorted(labels.items()))]


def _until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def _streams(target: str, count: int, max_tokens: int) -> list[threading.Thread]:
    def one() -> None:
        with Client(target) as client:
            for _ in client.generate("gateway", max_tokens=max_tokens, timeout=60):
                pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def test_waiting_and_running_move_as_the_queue_does() -> None:
    server, url = _serve(
        "--devices", "cpu:1", "--max-batch", "2", "--step-ms", "20", "--served-model-name", "m1"
    )
    try:

        def gauges(page: dict | None = None) -> tuple[float, ...]:
            page = page or _scrape(url)
            return tuple(_gauge(page, name, model_name="m1") for name in GATEWAY)

        assert gauges() == (0, 0, 0)
        # Six streams of 2 s, two places in a step: four wait, two run.
        threads = _streams(server.target, 6, 100)
        _until(lambda: gauges() == (4, 2, 0), "4 waiting, 2 running")
        # As the first two end, the next two take their places, then the last two.
        _until(lambda: gauges() == (0, 2, 0), "none waiting, 2 running")
        for t in threads:
            t.join(30)
        page = _scrape(url)
        assert gauges(page) == (0, 0, 0)
        # The synthetic engine holds no KV cache: 0 all along (above); the batch size of an
        # idle worker is 0, not its last step's.
        assert _gauge(page, "cadence_worker_batch_size", worker="0") == 0
    finally:
        server.stop()


@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("torch"),
    reason="the torch engine needs cadence[torch]",
)
def test_kv_cache_usage_is_the_torch_engines_cache_held() -> None:
    server, url = _serve(
        "--model",
        "tiny",
        "--devices",
        "cpu:1",
        "--kv-cache-tokens",
        "1024",
        "--served-model-name",
        "m1",
    )
    try:

        def usage() -> float:
            return _gauge(_scrape(url), "vllm:kv_cache_usage_perc", model_name="m1")

        assert usage() == 0
        # Long enough to be seen: the tiny model's 30 tokens can start and end between two
        # scrapes of a busy host.
        threads = _streams(server.target, 1, 300)
        _until(lambda: usage() > 0, "KV cache held")
        seen = usage()
        assert 0 < seen <= 1
        for t in threads:
            t.join(60)
        assert usage() == 0
    finally:
        server.stop()
