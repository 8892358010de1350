"""Prometheus scraping of a cadence server's /metrics page during a run, and what the scrapes
say about each worker's start-up."""

from __future__ import annotations

from cadence.lab.measure.prometheus import read_page

SCRAPED_GAUGES = ("cadence_deepest_buffer_steps", "cadence_active_streams",
                   "cadence_worker_batch_size", "cadence_paused_sequences")
SCRAPED_COUNTERS = ("cadence_merged_steps_total", "cadence_buffer_overflows_total",
                     "cadence_sequence_pauses_total", "cadence_chunks_total",
                     "cadence_output_tokens_total")


LOOP_SAMPLES = "cadence_event_loop_lag_seconds_count"
_LOOP_LAG = (LOOP_SAMPLES, "cadence_event_loop_lag_seconds_bucket")
_LATE_S = "0.02"
"""The bucket bound above which a wake-up of the front's loop counts as late."""
LOOP_ON_TIME = f"cadence_event_loop_lag_seconds_bucket{{le={_LATE_S}}}"


_STARTUP_GAUGES = ("cadence_worker_load_seconds", "cadence_worker_warmup_seconds",
                   "cadence_worker_first_step_seconds", "cadence_worker_warm_step_seconds")
"""Each worker's start-up (its last start), kept apart from SCRAPED_GAUGES: they hold still
during a run, so peaks of them would say nothing."""
_STARTUP_COUNTERS = ("cadence_worker_restarts_total",)
"""Per worker, so not among SCRAPED_COUNTERS (whose growth is taken under the bare name)."""
_STARTUP = _STARTUP_GAUGES + _STARTUP_COUNTERS


_MAX_OVER_FRONTS = ("cadence_deepest_buffer_steps", *_STARTUP)
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
        if (name in SCRAPED_GAUGES or name in SCRAPED_COUNTERS or name in _STARTUP
                or (name in _LOOP_LAG and labels.get("le", _LATE_S) == _LATE_S)):
            values[_key(name, labels)] = value
            if "front" in labels:
                rest = {k: v for k, v in labels.items() if k != "front"}
                key = _key(name, rest)
                if key not in combined:
                    combined[key] = value
                elif name in _MAX_OVER_FRONTS:
                    combined[key] = max(combined[key], value)
                else:
                    combined[key] += value
    return {**values, **combined}


_STARTUP_FIELDS = (("load_s", "cadence_worker_load_seconds"),
                   ("warmup_s", "cadence_worker_warmup_seconds"),
                   ("first_step_s", "cadence_worker_first_step_seconds"),
                   ("warm_step_s", "cadence_worker_warm_step_seconds"),
                   ("restarts", "cadence_worker_restarts_total"))


def worker_startup(server_metrics: dict | None) -> list[dict]:
    """Each worker's start-up from a run's scrapes (`server_metrics` of a bench result):
    [{"worker": 0, "load_s", "warmup_s", "first_step_s", "warm_step_s", "restarts",
    "restarts_during_run"}, ...], from the last scrape (a worker restarted during the run shows
    its new start). A field the server did not export is None; [] when no worker has any
    (no scrape, an app server, or a result saved before the server exported them).
    """
    samples = (server_metrics or {}).get("samples") or []
    if not samples:
        return []
    first, last = samples[0][1], samples[-1][1]
    workers: dict[int, dict] = {}
    for key, value in last.items():
        name, _, labels = key.partition("{")
        # Only the keys labelled by worker alone: with `--fronts N` those hold the value
        # over all fronts, and the per-front copies (front=K,worker=W) repeat it.
        if name in _STARTUP and labels.startswith("worker=") and "," not in labels:
            worker = int(labels[len("worker="):].rstrip("}"))
            workers.setdefault(worker, {})[name] = value
    rows = []
    for worker in sorted(workers):
        found = workers[worker]
        row: dict = {"worker": worker}
        for field, name in _STARTUP_FIELDS:
            row[field] = found.get(name)
        restarts_key = _key("cadence_worker_restarts_total", {"worker": str(worker)})
        row["restarts_during_run"] = (None if row["restarts"] is None
                                      else row["restarts"] - first.get(restarts_key, 0.0))
        rows.append(row)
    return rows


def _key(name: str, labels: dict[str, str]) -> str:
    text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{text}}}" if text else name
