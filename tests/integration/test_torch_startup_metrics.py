"""Start-up apart from serving: a torch worker's model load, warm-up, and cold first step
against a warm one, on the front's /metrics and read back by the lab; a restart overwrites
them and counts."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")

from cadence.client import Client
from cadence.lab.measure.discovery import metrics_url
from cadence.lab.measure.scrape import scrape

_STARTUP = (
    "cadence_worker_load_seconds",
    "cadence_worker_warmup_seconds",
    "cadence_worker_first_step_seconds",
    "cadence_worker_warm_step_seconds",
)


@pytest.mark.slow
def test_tiny_model_start_up_is_exported_and_a_restart_overwrites_it(server_factory) -> None:
    server = server_factory("--model", "tiny", "--metrics-port", "0")
    url = metrics_url(server.target)  # as the lab finds it
    assert url is not None
    first = scrape(url)
    for name in _STARTUP:
        assert first[f"{name}{{worker=0}}"] > 0, name
    assert first["cadence_worker_restarts_total{worker=0}"] == 0

    # A killed worker comes back with a start of its own: new values, one restart.
    os.kill(server.workers[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    with Client(server.target) as client:
        while True:
            time.sleep(0.2)
            # Health first, then the page: a page scraped before the replacement was ready
            # would hold the first start's values even if health turned SERVING after it.
            serving = client.health("cadence.worker.0") == "SERVING"
            again = scrape(url)
            if again["cadence_worker_restarts_total{worker=0}"] == 1 and serving:
                break
            assert time.monotonic() < deadline, "the killed worker was not restarted"
    assert again["cadence_worker_load_seconds{worker=0}"] > 0
    assert (
        again["cadence_worker_load_seconds{worker=0}"]
        != first["cadence_worker_load_seconds{worker=0}"]
    )
