"""examples/grafana/cadence.json: a Grafana dashboard whose every query names a metric that a
real `cadence serve --metrics-port` exports (scraped here, after a few requests), and returns a
series when a real Prometheus (Debian's `prometheus`) scrapes a real server under load."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Self

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cadence.client import Client
from cadence.lab.load.kserve import KServeTarget, build_request
from cadence.lab.load.plan import RequestPlan
from cadence.proto.kserve import grpc_service_pb2_grpc as kpb_grpc
from tests.integration.conftest import start_server

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
    out = [
        (f"panel {panel.get('title')!r}", target["expr"])
        for panel in _panels(dashboard["panels"])
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") == "query":
            query = variable["query"]
            out.append(
                (
                    f"variable {variable['name']!r}",
                    query["query"] if isinstance(query, dict) else query,
                )
            )
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
    return {
        name: where for name, where in dashboard_metrics(dashboard).items() if name not in exported
    }


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
    dashboard["panels"].append(
        {
            "type": "timeseries",
            "title": "bogus",
            "id": 999,
            "gridPos": {"h": 1, "w": 1, "x": 0, "y": 0},
            "targets": [
                {
                    "expr": "sum(rate(cadence_no_such_thing_total[5m])) / "
                    "sum(rate(cadence_requests[5m]))"
                }
            ],
        }
    )
    assert set(missing_metrics(dashboard, exported)) == {
        "cadence_no_such_thing_total",
        "cadence_requests",
    }
    dashboard["panels"][-1]["targets"] = [
        {"expr": 'rate(cadence_event_loop_lag_seconds_bucket{le="0.03"}[1m])'}
    ]
    assert missing_buckets(dashboard, {"cadence_event_loop_lag_seconds_bucket": {"0.02"}}) == [
        "panel 'bogus': cadence_event_loop_lag_seconds_bucket{le='0.03'}"
    ]


def _scrape(*args: str) -> list:
    """The metric families of a real server with `args`, after a few requests."""
    with start_server(
        "--metrics-port", "0", "--devices", "cpu:2", "--step-ms", "5", *args
    ) as server:
        url = server.metrics_url
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
    """The dashboard's `front` variable and `by (front)` sums rely on the label. The gateway's
    gauges under vLLM's names describe the whole server: one series each, no front."""
    every = [s for f in scraped["2 fronts"] for s in f.samples]
    samples = [s for s in every if s.name.startswith("cadence_")]
    assert samples and all("front" in s.labels for s in samples)
    assert {s.labels["front"] for s in samples} == {"0", "1"}
    gateway = [s for s in every if s.name.startswith("vllm:")]
    assert len(gateway) == 3 and not any("front" in s.labels for s in gateway)


# --- the dashboard against a real Prometheus --------------------------------------------------

_RATE_INTERVAL = "10s"
"""What Grafana's $__rate_interval would be at a 1 s scrape interval is 4 s (four scrapes);
10 s keeps two samples in every window when a shared CI machine delays a scrape or two."""
_GRAFANA_GLOBALS = {
    "__rate_interval": _RATE_INTERVAL,
    "__interval": "2s",
    "__range": "1m",
    "__interval_ms": "2000",
    "__range_s": "60",
    "__range_ms": "60000",
}
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$", re.DOTALL)


def _substitute(expr: str, values: dict[str, str]) -> str:
    """A query as Grafana sends it: every `$var` / `${var}` replaced; an unknown one fails
    (a variable added to the dashboard must be resolved here too)."""

    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"no value for the dashboard variable ${name} in {expr!r}"
        return values[name]

    return _VARIABLE.sub(one, expr)


def _prometheus_get(base: str, path: str, **params: str) -> object:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]


def _resolve_variables(dashboard: dict, base: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each query variable's values, found the way Grafana finds them (`label_values(SELECTOR,
    LABEL)` is Prometheus's label-values API with SELECTOR as match[]), in dashboard order so
    a variable can use the ones before it; and what Grafana would put in place of each
    variable (stops at the first variable with no values)."""
    values: dict[str, str] = dict(_GRAFANA_GLOBALS)
    found: dict[str, list[str]] = {}
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        query = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(query)
        assert match, f"variable {variable['name']!r}: only label_values(...) is resolved here"
        selector, label = _substitute(match.group(1), values), match.group(2)
        found[variable["name"]] = _prometheus_get(
            base, f"/api/v1/label/{label}/values", **{"match[]": selector}
        )
        if not found[variable["name"]]:
            break
        # "All" sends allValue; a single-valued variable sends its first value (Grafana's
        # default, and this Prometheus scrapes one server).
        values[variable["name"]] = (
            variable["allValue"] if variable.get("includeAll") else found[variable["name"]][0]
        )
    return found, values


def _empty_queries(dashboard: dict, base: str, values: dict[str, str]) -> list[str]:
    """The panel queries that return no series, or only NaN (a quantile over no requests)."""
    empty = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = _substitute(target["expr"], values)
            data = _prometheus_get(base, "/api/v1/query", query=expr)
            finite = [s for s in data["result"] if not math.isnan(float(s["value"][1]))]
            if not finite:
                empty.append(
                    f"panel {panel['title']!r} [{target['refId']}] "
                    f"({len(data['result'])} series, none finite): {expr}"
                )
    return empty


def _banner_address(banner: str, what: str) -> str:
    return re.search(rf"\({what} on (\S+?)\)", banner).group(1)


class _Load:
    """Requests over every protocol in a loop until stopped (cadence.v1 by cadence's client,
    KServe by the lab's request over plain grpc, OpenAI by SSE over HTTP), each followed now
    and then by one the server refuses, so the refusal panels have codes to show."""

    def __init__(self, target: str, http: str) -> None:
        self._target, self._http = target, http
        self._stop = threading.Event()
        self.errors: list[str] = []
        self.done = {"cadence.v1": 0, "kserve": 0, "openai": 0}
        self._threads = [
            threading.Thread(target=self._loop, args=(name, run), daemon=True)
            for name, run in (
                ("cadence.v1", self._cadence),
                ("kserve", self._kserve),
                ("openai", self._openai),
            )
        ]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _loop(self, name: str, run) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                run(i, refused=i % 5 == 4)
                self.done[name] += 1
            except Exception as exc:
                self.errors.append(f"{name}: {exc!r}")
                return
            i += 1

    def _cadence(self, i: int, refused: bool) -> None:
        with Client(self._target) as client:
            if not refused:
                assert list(client.generate(f"grafana {i}", max_tokens=24, timeout=30))
                return
            try:
                list(client.generate("refused", max_tokens=0, timeout=30))
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            else:
                raise AssertionError("max_tokens=0 was served")

    def _kserve(self, i: int, refused: bool) -> None:
        model = "no-such-model" if refused else "cadence"
        request = build_request(KServeTarget(model), RequestPlan(f"k{i}", [70, 71, 72], 24))
        with grpc.insecure_channel(self._target) as channel:
            responses = list(
                kpb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                    iter((request,)), timeout=30
                )
            )
        errors = [r.error_message for r in responses if r.error_message]
        assert bool(errors) == refused, errors

    def _openai(self, i: int, refused: bool) -> None:
        body = json.dumps(
            {
                "model": "no-such-model" if refused else "cadence",
                "prompt": f"grafana {i}",
                "max_tokens": 24,
                "stream": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://{self._http}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert b"data: [DONE]" in reply.read()
            assert not refused
        except urllib.error.HTTPError as exc:
            assert refused and exc.code == 404, exc


@pytest.fixture
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "`prometheus` is not on PATH (Debian: apt-get install prometheus; .ci/run installs it)"
        )
    return binary


@pytest.mark.slow
def test_every_dashboard_query_returns_a_series_from_a_real_prometheus(
    prometheus_binary: str, tmp_path: Path
) -> None:
    """A real Prometheus scrapes a real server (--fronts 2: every panel has something to show,
    front restarts included) under load over all three protocols; each panel query, with the
    dashboard's variables resolved through Prometheus as Grafana resolves them, returns a
    series with a number in it."""
    dashboard = _load()
    with start_server(
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        "--fronts",
        "2",
        "--devices",
        "cpu:2",
        "--step-ms",
        "5",
    ) as server:
        metrics = _banner_address(server.banner, "metrics")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        (tmp_path / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: cadence\n    static_configs:\n"
            f"      - targets: ['{metrics}']\n"
        )
        log = (tmp_path / "prometheus.log").open("w")
        prometheus = subprocess.Popen(
            [
                prometheus_binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            with _Load(server.target, _banner_address(server.banner, "http")) as load:
                deadline = time.monotonic() + 90
                targets: list = []
                while True:
                    assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()
                    try:
                        targets = _prometheus_get(base, "/api/v1/targets")["activeTargets"]
                        if targets and all(t["health"] == "up" for t in targets):
                            break
                    except OSError:
                        pass  # not listening yet
                    assert time.monotonic() < deadline, f"the target never came up: {targets}"
                    time.sleep(0.2)
                # Asked again until every query has its series (a rate needs two scrapes of
                # the load in its window) or the deadline passes; the last answers are the verdict.
                while True:
                    assert not load.errors, load.errors
                    found, values = _resolve_variables(dashboard, base)
                    empty = [f"variable {name!r}" for name, got in found.items() if not got]
                    if not empty:
                        empty = _empty_queries(dashboard, base, values)
                    if not empty or time.monotonic() > deadline:
                        break
                    time.sleep(1)
            assert not load.errors, load.errors
            assert not empty, "queries with no series:\n" + "\n".join(empty)
            assert found["instance"] == [metrics]
            assert set(found["front"]) == {"0", "1"} and set(found["worker"]) == {"0", "1"}
            assert set(found["protocol"]) == {"cadence.v1", "kserve", "openai"}
            assert all(load.done.values()), load.done
            # The check is not empty-handed: a panel over a series nobody exports is caught.
            dashboard["panels"] = [
                {
                    "title": "bogus",
                    "targets": [
                        {
                            "refId": "A",
                            "expr": (
                                'sum(rate(cadence_requests_total{instance="$instance", protocol="grpc"}'
                                "[$__rate_interval]))"
                            ),
                        }
                    ],
                }
            ]
            assert len(_empty_queries(dashboard, base, values)) == 1
        finally:
            prometheus.terminate()
            prometheus.wait(30)
            log.close()
