"""Each worker's start-up, from the scrapes of a cadence server's /metrics page that a bench
result keeps (`measure/scrape.py` takes them; the report shows these rows)."""

from __future__ import annotations

from cadence.lab.scraped_keys import STARTUP, STARTUP_FIELDS, series_key


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
        if name in STARTUP and labels.startswith("worker=") and "," not in labels:
            worker = int(labels[len("worker=") :].rstrip("}"))
            workers.setdefault(worker, {})[name] = value
    rows = []
    for worker in sorted(workers):
        found = workers[worker]
        row: dict = {"worker": worker}
        for field, name in STARTUP_FIELDS:
            row[field] = found.get(name)
        restarts_key = series_key("cadence_worker_restarts_total", {"worker": str(worker)})
        row["restarts_during_run"] = (
            None if row["restarts"] is None else row["restarts"] - first.get(restarts_key, 0.0)
        )
        rows.append(row)
    return rows
