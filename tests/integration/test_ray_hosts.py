"""`cadence serve --launcher ray` across two real hosts on one machine.

Two network namespaces joined by a veth pair are the hosts: a Ray head in one (with the
front, the Ray driver), a Ray node in the other, one `card` each, one shared RAY_AUTH_TOKEN.
A second veth pair lets this test process (in the root namespace) reach the front's gRPC
port. The tiny torch model is served with TP=2 across the two hosts and as two replicas;
greedy tokens must equal transformers'; a worker killed with SIGKILL ends its streams with
UNAVAILABLE and service recovers. Every namespace and every process in them is removed at
the end, by PID (never `ray stop`, which matches processes by name machine-wide).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

# One group under `pytest -n`: the emulated hosts' namespaces and addresses are fixed.
pytestmark = [
    pytest.mark.torch,
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.xdist_group("netns_hosts"),
]
pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")
pytest.importorskip("ray", reason="--launcher ray needs the ray extra (pip install '.[ray]')")

from cadence.client import Client, build_request
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import serve_refused, start_server
from tests.llama_models import PROMPTS, hf_greedy, save_model
from tests.netns_hosts import Front, TwoHosts, ip, netns_unavailable

N = 12


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Iterator[TwoHosts]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    hosts = TwoHosts()
    try:
        hosts.open(tmp_path_factory.mktemp("ray-logs"))
        yield hosts
    finally:
        hosts.close()
    assert not hosts.pids()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("ray-model") / "model")


def _greedy(target: str, prompts: list[str]) -> list[list[int]]:
    with Client(target) as client:
        outputs = []
        for prompt in prompts:
            tokens: list[int] = []
            for chunk in client.generate(prompt, max_tokens=N, timeout=60):
                assert chunk.index == len(tokens)
                tokens.extend(chunk.token_ids)
            outputs.append(tokens)
        return outputs


def _expected(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [hf_greedy(model_dir, tokenizer(p).input_ids, N) for p in PROMPTS]


@pytest.mark.timeout(400)
def test_tensor_parallel_group_across_two_hosts(hosts, model_dir, tmp_path) -> None:
    front = Front(
        hosts, tmp_path / "front.log", "--model", str(model_dir), "--devices", "cpu:2", "--tp", "2"
    )
    try:
        log = front.log.read_text()
        placed = re.search(r"worker 0 placed on (\S+), (\S+)", log)
        assert placed and {placed.group(1), placed.group(2)} == {hosts.HEAD, hosts.NODE}, log
        assert _greedy(front.target, PROMPTS) == _expected(model_dir)
    finally:
        assert front.stop() == 0


def _assert_cut(exc: grpc.RpcError) -> None:
    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
    assert "worker 1" in exc.details(), exc.details()


def _kill_worker_1_mid_stream(target: str, pid: int, attempt: int) -> int:
    """Four long streams in flight at once, spread over both replicas; worker 1 killed as
    soon as one of them shows it is there. Returns how many of worker 1's streams were cut
    (UNAVAILABLE, naming it); worker 0's go on. On a busy host one of worker 1's may have
    ended before the kill reached it: then it must be whole, up to its finish reason."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        calls = [
            stub.Generate(
                build_request(f"long {attempt}.{i}", max_tokens=240, include_timing=True),
                timeout=120,
            )
            for i in range(4)
        ]
        workers: list[int] = []
        cut = 0
        for call in calls:
            try:
                workers.append(next(call).timing.worker)
            except grpc.RpcError as exc:  # worker 1 died before this stream's first chunk
                _assert_cut(exc)
                workers.append(-1)
                cut += 1
                continue
            if workers[-1] == 1 and workers.count(1) == 1:
                os.kill(pid, signal.SIGKILL)
        assert {0, 1} <= {1 if w == -1 else w for w in workers}  # least-loaded spreads them
        for call, worker in zip(calls, workers):
            if worker == 0:  # the other replica's streams go on
                assert all(next(call).token_ids for _ in range(5))
                call.cancel()
            elif worker == 1:
                try:
                    rest = list(call)
                except grpc.RpcError as exc:
                    _assert_cut(exc)
                    cut += 1
                else:
                    assert rest and rest[-1].finish_reason, "ended OK without a finish reason"
    return cut


@pytest.mark.timeout(400)
def test_replicas_on_two_hosts_survive_a_killed_worker(hosts, model_dir, tmp_path) -> None:
    front = Front(hosts, tmp_path / "front.log", "--model", str(model_dir), "--devices", "cpu:2")
    try:
        log = front.log.read_text()
        nodes = set(re.findall(r"worker \d placed on (\S+)", log))
        assert nodes == {hosts.HEAD, hosts.NODE}, log
        expected = _expected(model_dir)
        assert _greedy(front.target, PROMPTS) == expected

        with Client(front.target) as client:
            for attempt in range(3):  # a busy host may let a short stream end before the kill
                pids = front.worker_pids()
                cut = _kill_worker_1_mid_stream(front.target, pids[1], attempt)
                deadline = time.monotonic() + 120
                while (
                    front.worker_pids()[1] == pids[1]  # its replacement is up
                    or client.health("cadence.worker.1") != "SERVING"
                ):
                    assert time.monotonic() < deadline, front.log.read_text()[-3000:]
                    time.sleep(0.2)
                if cut:
                    break
            assert cut, "every stream on worker 1 ended before the kill, three times"
        assert _greedy(front.target, PROMPTS * 2) == expected * 2  # both replicas again
    finally:
        assert front.stop() == 0


@pytest.mark.timeout(300)
def test_a_cut_link_is_noticed_by_the_heartbeat(hosts, tmp_path) -> None:
    """Ray alone takes about a minute to notice a cut link; the heartbeat ends the streams of
    the worker behind it within its timeout, that worker exits on its own, and once the link
    is back its replacement serves."""
    front = Front(hosts, tmp_path / "front.log", "--devices", "cpu:2", "--step-ms", "10")
    try:
        placed = {
            address: int(w)
            for w, address in re.findall(r"worker (\d) placed on (\S+)", front.log.read_text())
        }
        remote = placed[hosts.NODE]
        old_pid = front.worker_pids()[remote]
        with Client(front.target) as client:
            streams = [
                client.generate(f"s{i}", max_tokens=10_000, include_timing=True, timeout=120)
                for i in range(4)
            ]
            workers = [next(s).timing.worker for s in streams]
            assert remote in workers
            cut = time.monotonic()
            ip("-n", hosts.b, "link", "set", "cad0", "down")
            try:
                stream = streams[workers.index(remote)]
                with pytest.raises(grpc.RpcError) as ended:
                    list(stream)
                noticed = time.monotonic() - cut
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "heartbeat" in ended.value.details()
                assert noticed < 10, noticed  # heartbeat timeout 2 s; Ray alone: about 60 s
                deadline = time.monotonic() + 15
                while _alive(old_pid):  # it heard no front either, and left
                    assert time.monotonic() < deadline, "the cut-off worker did not exit"
                    time.sleep(0.1)
            finally:
                ip("-n", hosts.b, "link", "set", "cad0", "up")
            for stream, worker in zip(streams, workers):
                if worker != remote:
                    assert next(stream).token_ids  # the local replica kept streaming
                    stream.close()
            deadline = time.monotonic() + 120
            while client.health(f"cadence.worker.{remote}") != "SERVING":
                assert time.monotonic() < deadline, front.log.read_text()[-3000:]
                time.sleep(0.2)
            assert len(list(client.generate("after", max_tokens=20, timeout=30))) >= 1
        print(f"cut link noticed after {noticed:.2f} s")
    finally:
        assert front.stop() == 0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_unreachable_ray_cluster_is_a_clear_start_up_error() -> None:
    out = serve_refused("--launcher", "ray", "--ray-address", "127.0.0.1:1")
    assert out.returncode != 0
    assert "cannot reach the Ray cluster at 127.0.0.1:1" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_own_ray_instance_ignores_a_stale_current_cluster_file(monkeypatch) -> None:
    # A Ray head that died without cleaning up leaves ray_current_cluster behind; without
    # --ray-address, cadence starts its own Ray instead of joining that dead address.
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="cr"))  # short: Ray's socket paths must fit
    (temp / "ray").mkdir()
    (temp / "ray" / "ray_current_cluster").write_text("10.213.9.9:6379")
    monkeypatch.setenv("RAY_TMPDIR", str(temp))

    try:
        with (
            start_server("--launcher", "ray", "--devices", "cpu:1", "--step-ms", "1") as server,
            Client(server.target) as client,
        ):
            chunks = list(client.generate("hello", max_tokens=4, timeout=30))
        assert sum(len(c.token_ids) for c in chunks) == 4
    finally:
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def test_sigterm_to_the_whole_process_group_stops_everything_within_the_drain() -> None:
    # systemd's KillMode=control-group and `kill -TERM -- -PGID` signal the front and the Ray
    # instance it started together; the front must neither hang on Ray nor leave a process.
    drain_s = 2.0
    # Its own start (a session of its own, the output merged): not start_server's.
    process = subprocess.Popen(  # own start
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "serve",
            "--port",
            "0",
            "--launcher",
            "ray",
            "--devices",
            "cpu:1",
            "--step-ms",
            "1",
            "--drain-timeout",
            str(drain_s),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output = []
        for line in process.stdout:
            output.append(line)
            if "cadence serving on" in line:
                break
        assert process.poll() is None, "".join(output)
        processes = psutil.Process(process.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in processes)
        started = time.monotonic()
        os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(timeout=drain_s + 15) == 0, "".join(output) + process.stdout.read()
        assert time.monotonic() - started < drain_s + 6
        deadline = time.monotonic() + 3
        left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, [p.name() for p in left]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
