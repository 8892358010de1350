"""The Kubernetes manifests (deploy/kubernetes): rendered by kustomize, valid against the
Kubernetes schemas (`kubernetes-validate --strict`), clean under `checkov`, holding the
Grafana dashboard unchanged, their timings consistent; and their stopping sequence played
against a real server with open streams: readiness probes, preStop, SIGTERM, SIGKILL at the
grace.

The tools come from `.venv-deploy` (made by .ci/run: checkov pins many packages of its own)
or PATH; kustomize is `kubectl kustomize` or `kustomize`. Where one is missing the tests that
need it skip, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import threading
import time

import grpc
import pytest
import yaml

from cadence.client import Client
from tests.integration.conftest import start_server
from tests.integration.test_container import stream_in_background

ROOT = pathlib.Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
VARIANTS = ("base", "gpu")
"""The kustomizations: CPU workers, and the overlay with one worker per NVIDIA card."""
EXAMPLES = sorted((KUBE / "examples").glob("*.yaml"))
CUSTOM_KINDS = {"ServiceMonitor", "InferencePool", "HTTPRoute", "ScaledObject"}
"""Kinds of custom resources, which the Kubernetes schemas do not hold (their operators'
CRDs check them when applied)."""


def _tool(name: str) -> str:
    for found in (ROOT / ".venv-deploy" / "bin" / name, shutil.which(name)):
        if found and os.access(found, os.X_OK):
            return str(found)
    _missing(f"{name} (pip install it into .venv-deploy, as .ci/run does)")


def _missing(what: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must validate the manifests, but {what} is missing")
    pytest.skip(f"{what} is not installed")


def _kustomize(directory: pathlib.Path) -> str:
    if shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(directory)]
    elif shutil.which("kustomize"):
        command = ["kustomize", "build", str(directory)]
    else:
        _missing("kustomize (kubectl kustomize, or kustomize)")
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Each variant rendered to one file, and each example as it is."""
    out = tmp_path_factory.mktemp("rendered")
    files = {}
    for variant in VARIANTS:
        files[variant] = out / f"{variant}.yaml"
        files[variant].write_text(_kustomize(KUBE / variant))
    for example in EXAMPLES:
        files[example.stem] = example
    return files


def _documents(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _one(path: pathlib.Path, kind: str) -> dict:
    (found,) = [d for d in _documents(path) if d["kind"] == kind]
    return found


def _validate(*paths: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "--quiet", *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
    )


def _checkov(*paths: pathlib.Path) -> list[tuple[str, str]]:
    """checkov's failed checks on `paths`: (file name, check id) pairs."""
    files = [a for p in paths for a in ("-f", str(p))]
    result = subprocess.run(
        [
            _tool("checkov"),
            *files,
            "--framework",
            "kubernetes",
            "--quiet",
            "--skip-download",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
        check=False,
    )
    assert result.returncode in (0, 1), result.stderr
    reports = json.loads(result.stdout) if result.stdout.strip() else []
    if isinstance(reports, dict):
        reports = [reports]
    failed = [
        (pathlib.Path(c["file_path"]).name, c["check_id"])
        for r in reports
        for c in r.get("results", {}).get("failed_checks", [])
    ]
    assert bool(failed) == (result.returncode == 1)
    return failed


def test_every_manifest_is_valid_against_the_kubernetes_schemas(rendered) -> None:
    result = _validate(*rendered.values())
    assert result.returncode == 0, result.stdout + result.stderr
    # Only the custom resources go unchecked, not a built-in kind misspelt.
    for line in (result.stdout + result.stderr).splitlines():
        if "Couldn't find schema" in line:
            assert line.split(" for kind ")[1].split()[0] in CUSTOM_KINDS, line


def test_a_manifest_with_an_unknown_field_fails_validation(rendered, tmp_path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(rendered["base"].read_text().replace("periodSeconds:", "periodSecond:"))
    result = _validate(broken)
    assert result.returncode != 0
    assert "'periodSecond' was unexpected" in result.stdout + result.stderr


def test_every_manifest_passes_checkov_and_a_pod_that_may_escalate_fails(
    rendered, tmp_path
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        rendered["base"]
        .read_text()
        .replace("allowPrivilegeEscalation: false", "allowPrivilegeEscalation: true")
    )
    failed = _checkov(*rendered.values(), broken)  # one run: checkov takes seconds to start
    assert {name for name, _ in failed} == {"broken.yaml"}, failed
    assert ("broken.yaml", "CKV_K8S_20") in failed


def test_the_dashboard_configmap_is_the_grafana_example(rendered) -> None:
    example = json.loads((ROOT / "examples" / "grafana" / "cadence.json").read_text())
    for variant in VARIANTS:
        configmap = _one(rendered[variant], "ConfigMap")
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(configmap["data"]["cadence.json"]) == example


def _container(path: pathlib.Path) -> tuple[dict, dict, dict[str, str]]:
    pod = _one(path, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container, {e["name"]: e["value"] for e in container["env"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_pod_spec_keeps_its_promises(rendered, variant) -> None:
    pod, container, env = _container(rendered[variant])
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    # SIGKILL comes only after the preStop wait and the whole drain.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + float(env["CADENCE_DRAIN_TIMEOUT"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": int(env["CADENCE_PORT"]),
        "http": int(env["CADENCE_HTTP_PORT"]),
        "metrics": int(env["CADENCE_METRICS_PORT"]),
    }
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"]
    assert container["readinessProbe"]["failureThreshold"] == 1  # out at the drain's start
    assert "tcpSocket" in container["livenessProbe"]  # the kernel answers, busy or not
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    service = _one(rendered[variant], "Service")
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {
        name: name for name in ports
    }
    if variant == "gpu":  # one worker per card the pod is given
        cards = container["resources"]["limits"]["nvidia.com/gpu"]
        assert env["CADENCE_DEVICES"] == "cuda:" + ",".join(map(str, range(cards)))


def test_the_serve_settings_are_flags_of_cadence_serve(rendered) -> None:
    """Every CADENCE_ variable the manifests set names a flag `cadence serve` has (a typo
    would be ignored by the server, silently)."""
    from cadence.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    known = {serve.env_name(a) for a in serve._actions if a.option_strings and a.dest != "help"}
    for variant in VARIANTS:
        _, _, env = _container(rendered[variant])
        assert {name for name in env if name.startswith("CADENCE_")} <= known


STEP_MS = 20
STREAM_TOKENS = 100
"""Each stream: 2 s of steps, so all are open when the drain begins and finish within it."""


def test_kubernetes_stopping_sequence_cuts_no_stream(rendered) -> None:
    """Kubernetes' sequence at a tenth of the manifest's times: readiness probes all along,
    the preStop wait, SIGTERM, and SIGKILL at the grace; open streams all end whole, the
    readiness probe fails from the drain's start, and the server exits before the kill."""
    pod, container, env = _container(rendered["base"])
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"] / 10
    drain_s = float(env["CADENCE_DRAIN_TIMEOUT"]) / 10
    grace_s = pod["terminationGracePeriodSeconds"] / 10
    assert STREAM_TOKENS * STEP_MS / 1000 < drain_s
    server = start_server(
        "--devices", "cpu:2", "--step-ms", str(STEP_MS), "--drain-timeout", str(drain_s)
    )
    probes: list[str] = []
    stop_probing = threading.Event()

    def probe() -> None:  # the kubelet's readiness probe, faster than every 2 s
        with Client(server.target) as client:
            while not stop_probing.is_set():
                try:
                    probes.append(client.health())
                except grpc.RpcError as exc:
                    probes.append(exc.code().name)
                time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    streams, outcomes = zip(
        *(stream_in_background(server.target, STREAM_TOKENS) for _ in range(8)), strict=True
    )
    while not all(o["tokens"] for o in outcomes):
        time.sleep(0.01)
    time.sleep(pre_stop_s)  # preStop: still serving, as the endpoints drop the pod
    probes_before = len(probes)
    terminated = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # the kubelet's SIGKILL at the grace
        server.process.kill()
        code = server.process.wait()
    stopped_after_s = time.monotonic() - terminated
    stop_probing.set()
    for t in streams:
        t.join(10)
    prober.join(5)
    assert code == 0, f"killed at the grace ({grace_s} s) after {stopped_after_s:.1f} s"
    assert list(outcomes) == [{"tokens": STREAM_TOKENS}] * len(outcomes)
    before, after = probes[:probes_before], probes[probes_before:]
    assert set(before) == {"SERVING"}
    # From its first failure on, readiness never passes again: NOT_SERVING while the drain
    # runs, then no answer once the server is gone.
    assert "NOT_SERVING" in after
    first_failure = next(i for i, status in enumerate(after) if status != "SERVING")
    assert "SERVING" not in after[first_failure:]
    server.stop()  # the workers went with it
