"""examples/grafana/cadence.json: a Grafana dashboard whose every query names a metric that a
real `cadence serve --metrics-port` exports (scraped here, after a few requests)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cadence.client import Client
from cadence.lab.servers.server_process import ServerProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "cadence.json"

_METRIC = re.compile(r"(?<![A-Za-z0-9_:])cadence_[A-Za-z0-9_:]*")
_BUCKET_BOUND = re.compile(r"(cadence_[A-Za-z0-9_:]*_bucket)\{[^}]*\ble\s*=\s*\"([^\"]+)\"")


def _panels(panels: list[dict]) -> list[dict]:
    """Every panel, those inside (collapsed) rows included."""
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))
    return out


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = [(f"panel {panel.get('title')!r}", target["expr"])
           for panel in _panels(dashboard["panels"])
           for target in panel.get("targets", []) if "expr" in target]
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") == "query":
            query = variable["query"]
            out.append((f"variable {variable['name']!r}",
                        query["query"] if isinstance(query, dict) else query))
    return out


def dashboard_metrics(dashboard: dict) -> dict[str, set[str]]:
    """Each metric (sample) name the dashboard's queries use, and where it is used."""
    used: dict[str, set[str]] = {}
    for where, expr in _queries(dashboard):
        for name in _METRIC.findall(expr):
            used.setdefault(name, set()).add(where)
    return used


def missing_metrics(dashboard: dict, exported: set[str]) -> dict[str, set[str]]:
    """The names a query uses that no exported sample has. PromQL selects samples by their
    exposed name: a histogram's `_bucket`/`_sum`/`_count`, a counter's `_total`; so the bare
    family name of either (`cadence_requests`) matches nothing and counts as missing."""
    return {name: where for name, where in dashboard_metrics(dashboard).items()
            if name not in exported}


def missing_buckets(dashboard: dict, bounds: dict[str, set[str]]) -> list[str]:
    """`name_bucket{le="X"}` selectors whose bound X the histogram does not have."""
    out = []
    for where, expr in _queries(dashboard):
        for name, le in _BUCKET_BOUND.findall(expr):
            if not any(float(le) == float(b) for b in bounds.get(name, ())):
                out.append(f"{where}: {name}{{le={le!r}}}")
    return out


def _load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_has_a_grafana_dashboard_shape() -> None:
    dashboard = _load()
    assert dashboard["title"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int)
    assert dashboard["time"]["from"] and dashboard["refresh"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dashboard["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = 0
    for panel in panels:
        assert panel["type"], panel
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys() and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        graphs += 1
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), f"panel {panel['title']!r} has an empty query"
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert _METRIC.search(" ".join(t["expr"] for t in panel["targets"])), panel["title"]
    assert graphs >= 10


def test_a_panel_naming_an_unknown_metric_is_caught() -> None:
    """The check below fails for a query over a metric the server does not export."""
    dashboard = _load()
    exported = set(dashboard_metrics(dashboard))
    assert missing_metrics(dashboard, exported) == {}
    dashboard["panels"].append({
        "type": "timeseries", "title": "bogus", "id": 999, "gridPos": {"h": 1, "w": 1, "x": 0, "y": 0},
        "targets": [{"expr": "sum(rate(cadence_no_such_thing_total[5m])) / "
                             "sum(rate(cadence_requests[5m]))"}]})
    assert set(missing_metrics(dashboard, exported)) == {"cadence_no_such_thing_total",
                                                         "cadence_requests"}
    dashboard["panels"][-1]["targets"] = [
        {"expr": 'rate(cadence_event_loop_lag_seconds_bucket{le="0.03"}[1m])'}]
    assert missing_buckets(dashboard, {"cadence_event_loop_lag_seconds_bucket": {"0.02"}}) \
        == ["panel 'bogus': cadence_event_loop_lag_seconds_bucket{le='0.03'}"]


def _scrape(*args: str) -> list:
    """The metric families of a real server with `args`, after a few requests."""
    with ServerProcess("--metrics-port", "0", "--devices", "cpu:2", "--step-ms", "5",
                       *args) as server:
        url = "http://" + server.banner.rsplit("metrics on ", 1)[1].rstrip(")") + "/metrics"
        with Client(server.target) as client:
            for i in range(6):
                assert list(client.generate(f"dashboard {i}", max_tokens=8))
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    return list(text_string_to_metric_families(text))


@pytest.fixture(scope="module")
def scraped() -> dict[str, list]:
    # One front, and --fronts 2 (front restarts exist only there; every sample gets `front`).
    return {"1 front": _scrape(), "2 fronts": _scrape("--fronts", "2")}


def test_every_dashboard_metric_is_exported_by_a_real_server(scraped) -> None:
    samples = [s for families in scraped.values() for f in families for s in f.samples]
    exported = {s.name for s in samples}
    missing = missing_metrics(_load(), exported)
    assert not missing, f"the dashboard queries metrics no cadence server exports: {missing}"
    bounds: dict[str, set[str]] = {}
    for sample in samples:
        if "le" in sample.labels:
            bounds.setdefault(sample.name, set()).add(sample.labels["le"])
    assert missing_buckets(_load(), bounds) == []


def test_with_fronts_every_sample_names_its_front(scraped) -> None:
    """The dashboard's `front` variable and `by (front)` sums rely on the label."""
    samples = [s for f in scraped["2 fronts"] for s in f.samples]
    assert samples and all("front" in s.labels for s in samples)
    assert {s.labels["front"] for s in samples} == {"0", "1"}
