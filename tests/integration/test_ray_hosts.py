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
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from cadence.client import Client
from tests.llama_models import PROMPTS, hf_greedy, save_model

pytest.importorskip("ray", reason="--launcher ray needs the ray extra (pip install '.[ray]')")

N = 12
VENV_BIN = Path(sys.executable).parent
_BANNER = re.compile(r"cadence serving on (\S+):(\d+)")
_READY = re.compile(r"worker (\d+) ready \(pid (\d+)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TwoHosts:
    """Two namespaces `a` (10.213.0.1, and 10.213.1.2 towards this process) and `b`
    (10.213.0.2), each with a Ray node, removed with everything in them by `close`."""

    HEAD, NODE, FRONT = "10.213.0.1", "10.213.0.2", "10.213.1.2"

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"cad{tag}a", f"cad{tag}b"
        self._root_link = f"cad{tag}r"
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
                        RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
        self._made: list[str] = []
        self.logs: list[Path] = []

    def open(self, log_dir: Path) -> None:
        for ns in (self.a, self.b):
            _ip("netns", "add", ns)
            self._made.append(ns)
        # The hosts' link: both ends are called cad0, each in its own namespace.
        _ip("link", "add", f"{self._root_link}x", "type", "veth", "peer", "name", f"{self._root_link}y")
        _ip("link", "set", f"{self._root_link}x", "netns", self.a)
        _ip("link", "set", f"{self._root_link}y", "netns", self.b)
        _ip("-n", self.a, "link", "set", f"{self._root_link}x", "name", "cad0")
        _ip("-n", self.b, "link", "set", f"{self._root_link}y", "name", "cad0")
        _ip("-n", self.a, "addr", "add", f"{self.HEAD}/24", "dev", "cad0")
        _ip("-n", self.b, "addr", "add", f"{self.NODE}/24", "dev", "cad0")
        # This process's way to the front in `a`.
        _ip("link", "add", self._root_link, "type", "veth", "peer", "name", f"{self._root_link}c")
        _ip("link", "set", f"{self._root_link}c", "netns", self.a)
        _ip("-n", self.a, "addr", "add", f"{self.FRONT}/24", "dev", f"{self._root_link}c")
        _ip("addr", "add", "10.213.1.1/24", "dev", self._root_link)
        for ns in (self.a, self.b):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "cad0", "up")
        _ip("-n", self.a, "link", "set", f"{self._root_link}c", "up")
        _ip("link", "set", self._root_link, "up")
        common = ["--num-cpus", "1", "--resources", '{"card": 1}', "--object-store-memory",
                  "80000000", "--disable-usage-stats", "--block"]
        self.spawn(self.a, log_dir / "ray-head.log", str(VENV_BIN / "ray"), "start", "--head",
                   "--node-ip-address", self.HEAD, "--port", "6379", "--include-dashboard",
                   "false", *common)
        self._wait_for_port(self.a, self.HEAD, 6379, log_dir / "ray-head.log")
        self.spawn(self.b, log_dir / "ray-node.log", str(VENV_BIN / "ray"), "start", "--address",
                   f"{self.HEAD}:6379", "--node-ip-address", self.NODE, *common)

    def spawn(self, ns: str, log: Path, *argv: str) -> subprocess.Popen:
        """Run `argv` inside namespace `ns`, its output in `log`."""
        self.logs.append(log)
        out = open(log, "w")  # noqa: SIM115 - kept open for the process's life
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def _wait_for_port(self, ns: str, host: str, port: int, log: Path, timeout: float = 60) -> None:
        probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1)"
        deadline = time.monotonic() + timeout
        while subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe],
                             capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, f"Ray head never listened:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)

    def pids(self) -> list[int]:
        """Every process in either namespace."""
        pids: list[int] = []
        for ns in self._made:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            pids += [int(p) for p in out.split()]
        return pids

    def close(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self._root_link], capture_output=True)


def _netns_permitted() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (Debian's iproute2)"
    probe = f"cadprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Iterator[TwoHosts]:
    reason = _netns_permitted()
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


class Front:
    """`cadence serve --launcher ray` in namespace `a`, reached from here."""

    def __init__(self, hosts: TwoHosts, log: Path, *args: str) -> None:
        self.log = log
        self.process = hosts.spawn(
            hosts.a, log, sys.executable, "-m", "cadence.cli", "serve", "--launcher", "ray",
            "--ray-address", f"{hosts.HEAD}:6379", "--host", hosts.FRONT, "--port", "0",
            "--startup-timeout", "120", "--heartbeat-timeout", "2", *args,
        )
        deadline = time.monotonic() + 150
        while not (match := _BANNER.search(log.read_text())):
            assert self.process.poll() is None, f"front exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"front never served:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        self.target = f"{match.group(1)}:{match.group(2)}"

    def worker_pids(self) -> dict[int, int]:
        """Each worker's rank-0 pid, from the latest 'ready' line of each."""
        return {int(w): int(p) for w, p in _READY.findall(self.log.read_text())}

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)


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
    front = Front(hosts, tmp_path / "front.log", "--model", str(model_dir), "--devices", "cpu:2",
                  "--tp", "2")
    try:
        log = front.log.read_text()
        placed = re.search(r"worker 0 placed on (\S+), (\S+)", log)
        assert placed and {placed.group(1), placed.group(2)} == {hosts.HEAD, hosts.NODE}, log
        assert _greedy(front.target, PROMPTS) == _expected(model_dir)
    finally:
        assert front.stop() == 0


@pytest.mark.timeout(400)
def test_replicas_on_two_hosts_survive_a_killed_worker(hosts, model_dir, tmp_path) -> None:
    front = Front(hosts, tmp_path / "front.log", "--model", str(model_dir), "--devices", "cpu:2")
    try:
        log = front.log.read_text()
        nodes = set(re.findall(r"worker \d placed on (\S+)", log))
        assert nodes == {hosts.HEAD, hosts.NODE}, log
        expected = _expected(model_dir)
        assert _greedy(front.target, PROMPTS) == expected

        pids = front.worker_pids()
        with Client(front.target) as client:
            streams = [client.generate(f"long {i}", max_tokens=240, include_timing=True,
                                       timeout=120) for i in range(4)]
            workers = [next(s).timing.worker for s in streams]
            assert set(workers) == {0, 1}  # least-loaded routing spreads them
            os.kill(pids[1], signal.SIGKILL)
            for stream, worker in zip(streams, workers):
                if worker == 1:
                    with pytest.raises(grpc.RpcError) as ended:
                        list(stream)
                    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "worker 1" in ended.value.details()
                else:  # the other replica's streams go on
                    assert all(next(stream).token_ids for _ in range(5))
                    stream.close()
            deadline = time.monotonic() + 120
            while client.health("cadence.worker.1") != "SERVING":
                assert time.monotonic() < deadline, front.log.read_text()[-3000:]
                time.sleep(0.2)
        assert front.worker_pids()[1] != pids[1]
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
        placed = dict((ip, int(w)) for w, ip in
                      re.findall(r"worker (\d) placed on (\S+)", front.log.read_text()))
        remote = placed[hosts.NODE]
        old_pid = front.worker_pids()[remote]
        with Client(front.target) as client:
            streams = [client.generate(f"s{i}", max_tokens=10_000, include_timing=True,
                                       timeout=120) for i in range(4)]
            workers = [next(s).timing.worker for s in streams]
            assert remote in workers
            cut = time.monotonic()
            _ip("-n", hosts.b, "link", "set", "cad0", "down")
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
                _ip("-n", hosts.b, "link", "set", "cad0", "up")
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
