"""Prometheus scraping of a cadence server's /metrics page during a run (what the scrapes say
about each worker's start-up is the analysis's: `analysis/startup.py`)."""

from __future__ import annotations

from cadence.lab.measure.prometheus import read_page
from cadence.lab.scraped_keys import STARTUP, series_key

SCRAPED_GAUGES = (
    "cadence_deepest_buffer_steps",
    "cadence_active_streams",
    "cadence_worker_batch_size",
    "cadence_paused_sequences",
)
SCRAPED_COUNTERS = (
    "cadence_merged_steps_total",
    "cadence_buffer_overflows_total",
    "cadence_sequence_pauses_total",
    "cadence_chunks_total",
    "cadence_output_tokens_total",
)


LOOP_SAMPLES = "cadence_event_loop_lag_seconds_count"
_LOOP_LAG = (LOOP_SAMPLES, "cadence_event_loop_lag_seconds_bucket")
_LATE_S = "0.02"
"""The bucket bound above which a wake-up of the front's loop counts as late."""
LOOP_ON_TIME = f"cadence_event_loop_lag_seconds_bucket{{le={_LATE_S}}}"


_MAX_OVER_FRONTS = ("cadence_deepest_buffer_steps", *STARTUP)
"""With `--fronts N`, values whose all-fronts value is the largest front's; the others (and
every other counter) add up: each front counts its own streams and its own share of each
worker's batch (a front's batch gauge holds its last step with any of its sequences, so the
sum can run ahead of the worker's batch while a front has none). The start-up values are the
worker's own, the same on every front that has them (restarts: front 0's alone), so adding
them up would count a worker once per front."""


def scrape(url: str) -> dict[str, float]:
    """The cadence gauges and counters of one /metrics page, keyed by name{labels}.

    Front 0 of `--fronts N` labels every front's samples with `front`: those are kept, and
    each is also combined over the fronts under its name without that label, so the same
    keys as with one front hold the whole server's values. Raises ScrapeError when the page
    cannot be read.
    """
    values: dict[str, float] = {}
    combined: dict[str, float] = {}
    for _, name, labels, value in read_page(url):
        if (
            name in SCRAPED_GAUGES
            or name in SCRAPED_COUNTERS
            or name in STARTUP
            or (name in _LOOP_LAG and labels.get("le", _LATE_S) == _LATE_S)
        ):
            values[series_key(name, labels)] = value
            if "front" in labels:
                rest = {k: v for k, v in labels.items() if k != "front"}
                key = series_key(name, rest)
                if key not in combined:
                    combined[key] = value
                elif name in _MAX_OVER_FRONTS:
                    combined[key] = max(combined[key], value)
                else:
                    combined[key] += value
    return {**values, **combined}
