"""The keys of a scraped cadence /metrics page as a bench result keeps them
(`ServerMetrics.samples`: every value by `name{labels}`), and the worker start-up series among
them: what the scraper (`measure/scrape.py`) writes and the analysis (`analysis/startup.py`)
reads, below both."""

from __future__ import annotations

STARTUP_GAUGES = (
    "cadence_worker_load_seconds",
    "cadence_worker_warmup_seconds",
    "cadence_worker_first_step_seconds",
    "cadence_worker_warm_step_seconds",
)
"""Each worker's start-up (its last start), kept apart from the scraper's gauges: they hold still
during a run, so peaks of them would say nothing."""
STARTUP_COUNTERS = ("cadence_worker_restarts_total",)
"""Per worker, so not among the scraper's counters (whose growth is taken under the bare name)."""
STARTUP = STARTUP_GAUGES + STARTUP_COUNTERS

STARTUP_FIELDS = (
    ("load_s", "cadence_worker_load_seconds"),
    ("warmup_s", "cadence_worker_warmup_seconds"),
    ("first_step_s", "cadence_worker_first_step_seconds"),
    ("warm_step_s", "cadence_worker_warm_step_seconds"),
    ("restarts", "cadence_worker_restarts_total"),
)
"""Each start-up series under the name a worker's start-up row gives it."""


def series_key(name: str, labels: dict[str, str]) -> str:
    """`name{k=v,...}`, the labels sorted: one series' key in a scrape."""
    text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{text}}}" if text else name
