"""The image's recipe (Containerfile): its entrypoint as a container runs it, and, where podman
is at hand and asked for, the image itself built and run: health, a stream, a drain on SIGTERM
within the grace.

The entrypoint test runs everywhere it can (root, `unshare`): `cadence serve` configured only
by CADENCE_* variables, as process 1 of its own PID namespace, as in a container.

The image test builds the image (a minute or more), so it runs only with
CADENCE_IMAGE_TEST=1 and podman installed:

    CADENCE_IMAGE_TEST=1 CADENCE_IMAGE_BASE=localhost/cadence-base:bookworm \\
    CADENCE_IMAGE_WHEELS=/path/to/wheels pytest tests/integration/test_container.py

CADENCE_IMAGE_BASE: a base image with python3 >= 3.11 (default: the Containerfile's);
CADENCE_IMAGE_WHEELS: a folder of wheels to install from instead of a package index;
CADENCE_PODMAN_RUN_ARGS: extra `podman run` options this host needs (docs/deploy.md).
"""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest

from cadence.client import Client
from tests.integration.conftest import _BANNER

ROOT = pathlib.Path(__file__).resolve().parents[2]
STREAM_TOKENS = 60
STEP_MS = 50
"""A stream of STREAM_TOKENS at STEP_MS per step lasts 3 s: open when the drain begins."""


def stream_in_background(target: str, tokens: int = STREAM_TOKENS) -> tuple[threading.Thread, dict]:
    """One stream of `tokens`, read to its end in a thread: its tokens, or its error."""
    outcome: dict = {"tokens": 0}

    def read() -> None:
        try:
            with Client(target) as client:
                for chunk in client.generate("drain me", max_tokens=tokens, timeout=60):
                    outcome["tokens"] += len(chunk.token_ids)
        except grpc.RpcError as exc:
            outcome["error"] = f"{exc.code().name}: {exc.details()}"

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, outcome


def _until_streaming(outcome: dict, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while outcome["tokens"] == 0 and "error" not in outcome:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.02)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare (util-linux) for a PID namespace",
)
def test_the_entrypoint_serves_and_drains_as_process_one() -> None:
    env = {
        **os.environ,
        "CADENCE_PORT": "0",
        "CADENCE_HOST": "127.0.0.1",
        "CADENCE_DEVICES": "cpu:2",
        "CADENCE_STEP_MS": str(STEP_MS),
        "CADENCE_DRAIN_TIMEOUT": "10",
        "CADENCE_LOG_LEVEL": "WARNING",
    }
    unshare = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            sys.executable,
            "-m",
            "cadence.cli",
            "serve",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = unshare.stdout.readline()
        match = _BANNER.search(line)
        assert match, f"no banner (exit {unshare.poll()}): {line!r}"
        target = f"{match.group(1)}:{match.group(2)}"
        front = psutil.Process(unshare.pid).children()[0]
        assert front.cmdline()[1:4] == ["-m", "cadence.cli", "serve"]
        with Client(target) as client:
            assert client.health() == "SERVING"
        thread, outcome = stream_in_background(target)
        _until_streaming(outcome)
        front.send_signal(signal.SIGTERM)  # what the container runtime sends process 1
        thread.join(15)
        assert outcome == {"tokens": STREAM_TOKENS}
        assert unshare.wait(15) == 0
    finally:
        if unshare.poll() is None:
            unshare.kill()
            unshare.wait()


def _podman(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], check=True, text=True, capture_output=True, **kwargs)


def _wheels(tmp_path: pathlib.Path) -> pathlib.Path:
    given = os.environ.get("CADENCE_IMAGE_WHEELS")
    if given:
        return pathlib.Path(given)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "-w",
            str(wheels),
            f"{ROOT}[fast,lab]",
            "setuptools",
        ],
        check=True,
    )
    for built in wheels.glob("cadence-*.whl"):
        built.unlink()  # the image builds cadence from its own copy of the source
    return wheels


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    os.environ.get("CADENCE_IMAGE_TEST") != "1" or shutil.which("podman") is None,
    reason="builds the image (minutes): set CADENCE_IMAGE_TEST=1, with podman",
)
def test_the_image_builds_serves_streams_and_drains(tmp_path: pathlib.Path) -> None:
    image = "localhost/cadence-test:cpu"
    build = [
        "build",
        "--isolation",
        "chroot",
        "-q",
        "-f",
        str(ROOT / "Containerfile"),
        "-t",
        image,
        "--build-arg",
        "PIP_ARGS=--no-index --find-links /wheels",
        "-v",
        f"{_wheels(tmp_path)}:/wheels:ro",
    ]
    if os.environ.get("CADENCE_IMAGE_BASE"):
        build += ["--build-arg", f"BASE={os.environ['CADENCE_IMAGE_BASE']}"]
    _podman(*build, str(ROOT))
    config = _podman(
        "image", "inspect", image, "--format", "{{.Config.User}} {{json .Config.Entrypoint}}"
    ).stdout.strip()
    assert config == '10001:10001 ["cadence","serve"]'
    grpc_port, http_port = _free_port(), _free_port()
    name = f"cadence-test-{os.getpid()}"
    run = [
        "run",
        "-d",
        "--name",
        name,
        "--read-only",
        "--tmpfs",
        "/tmp",
        *shlex.split(os.environ.get("CADENCE_PODMAN_RUN_ARGS", "")),
        "-p",
        f"127.0.0.1:{grpc_port}:50051",
        "-p",
        f"127.0.0.1:{http_port}:8000",
        "-e",
        "CADENCE_DEVICES=cpu:2",
        "-e",
        "CADENCE_DRAIN_TIMEOUT=10",
        image,
        "--step-ms",
        str(STEP_MS),
    ]
    _podman(*run)
    try:
        target = f"127.0.0.1:{grpc_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with Client(target) as client:
                    if client.health() == "SERVING":
                        break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, _podman("logs", name).stderr
            time.sleep(0.2)
        # gRPC health turned SERVING once start-up was over; HTTP /health follows the same policy.
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5):
                    break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and time.monotonic() < deadline
                time.sleep(0.2)
        thread, outcome = stream_in_background(target)
        _until_streaming(outcome)
        _podman("stop", "-t", "20", name)  # SIGTERM, then SIGKILL at 20 s (exit 137)
        thread.join(15)
        assert outcome == {"tokens": STREAM_TOKENS}
        assert _podman("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip() == "0"
        assert "stopped:" in _podman("logs", name).stderr
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True, check=False)
