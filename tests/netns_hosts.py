"""Emulated hosts for the lab and the tests: two network namespaces on this machine, each a
Ray node (`--launcher ray` across real sockets and a real link, which can be cut).

Needs root (or CAP_NET_ADMIN) and Debian's iproute2. Namespace `a` holds the Ray head and is
where the front runs; `b` holds a second Ray node; a veth pair joins them (10.213.0.0/24,
both ends named `cad0`, so one GLOO_SOCKET_IFNAME fits both), and a second pair lets the
calling process, in the root namespace, reach the front at 10.213.1.2. Everything is removed
by `close`, processes by PID (never `ray stop`, which matches processes by name). The Ray
nodes keep their sessions in a private temporary folder, not the shared /tmp/ray, whose
`ray_current_cluster` file would otherwise send every later `ray.init()` on this machine to
these namespaces' head after it is gone.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
_BANNER = re.compile(r"cadence serving on (\S+):(\d+)")
_READY = re.compile(r"worker (\d+) ready \(pid (\d+)")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TwoHosts:
    """Two namespaces `a` (10.213.0.1, and 10.213.1.2 towards this process) and `b`
    (10.213.0.2), each with a Ray node, removed with everything in them by `close`."""

    HEAD, NODE, FRONT = "10.213.0.1", "10.213.0.2", "10.213.1.2"

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"cad{tag}a", f"cad{tag}b"
        self._root_link = f"cad{tag}r"
        self.env = dict(
            os.environ,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=secrets.token_hex(16),
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONUNBUFFERED="1",
        )
        self._made: list[str] = []
        self.logs: list[Path] = []
        self._ray_dir = tempfile.mkdtemp(prefix="cadray-")
        """The nodes' --temp-dir (short: Ray's socket paths must fit in 107 bytes)."""

    def open(self, log_dir: Path) -> None:
        for ns in (self.a, self.b):
            ip("netns", "add", ns)
            self._made.append(ns)
        # The hosts' link: both ends are called cad0, each in its own namespace.
        ip(
            "link",
            "add",
            f"{self._root_link}x",
            "type",
            "veth",
            "peer",
            "name",
            f"{self._root_link}y",
        )
        ip("link", "set", f"{self._root_link}x", "netns", self.a)
        ip("link", "set", f"{self._root_link}y", "netns", self.b)
        ip("-n", self.a, "link", "set", f"{self._root_link}x", "name", "cad0")
        ip("-n", self.b, "link", "set", f"{self._root_link}y", "name", "cad0")
        ip("-n", self.a, "addr", "add", f"{self.HEAD}/24", "dev", "cad0")
        ip("-n", self.b, "addr", "add", f"{self.NODE}/24", "dev", "cad0")
        # This process's way to the front in `a`.
        ip("link", "add", self._root_link, "type", "veth", "peer", "name", f"{self._root_link}c")
        ip("link", "set", f"{self._root_link}c", "netns", self.a)
        ip("-n", self.a, "addr", "add", f"{self.FRONT}/24", "dev", f"{self._root_link}c")
        ip("addr", "add", "10.213.1.1/24", "dev", self._root_link)
        for ns in (self.a, self.b):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", "cad0", "up")
        ip("-n", self.a, "link", "set", f"{self._root_link}c", "up")
        ip("link", "set", self._root_link, "up")
        common = [
            "--num-cpus",
            "1",
            "--resources",
            '{"card": 1}',
            "--object-store-memory",
            "80000000",
            "--disable-usage-stats",
            "--block",
            "--temp-dir",
            self._ray_dir,
        ]
        self.spawn(
            self.a,
            log_dir / "ray-head.log",
            str(VENV_BIN / "ray"),
            "start",
            "--head",
            "--node-ip-address",
            self.HEAD,
            "--port",
            "6379",
            "--include-dashboard",
            "false",
            *common,
        )
        self._wait_for_port(self.a, self.HEAD, 6379, log_dir / "ray-head.log")
        self.spawn(
            self.b,
            log_dir / "ray-node.log",
            str(VENV_BIN / "ray"),
            "start",
            "--address",
            f"{self.HEAD}:6379",
            "--node-ip-address",
            self.NODE,
            *common,
        )

    def spawn(self, ns: str, log: Path, *argv: str) -> subprocess.Popen:
        """Run `argv` inside namespace `ns`, its output in `log`."""
        self.logs.append(log)
        out = open(log, "w")
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )

    def _wait_for_port(self, ns: str, host: str, port: int, log: Path, timeout: float = 60) -> None:
        probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1)"
        deadline = time.monotonic() + timeout
        while (
            subprocess.run(
                ["ip", "netns", "exec", ns, sys.executable, "-c", probe],
                check=False,
                capture_output=True,
            ).returncode
            != 0
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head never listened:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def pids(self) -> list[int]:
        """Every process in either namespace."""
        pids: list[int] = []
        for ns in self._made:
            out = subprocess.run(
                ["ip", "netns", "pids", ns], check=False, capture_output=True, text=True
            ).stdout
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
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self._root_link], check=False, capture_output=True)
        shutil.rmtree(self._ray_dir, ignore_errors=True)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (Debian's iproute2)"
    probe = f"cadprobe{os.getpid() % 100000}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], check=False, capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


class Front:
    """`cadence serve --launcher ray` in namespace `a`, reached from here."""

    def __init__(self, hosts: TwoHosts, log: Path, *args: str) -> None:
        self.log = log
        self.process = hosts.spawn(
            hosts.a,
            log,
            sys.executable,
            "-m",
            "cadence.cli",
            "serve",
            "--launcher",
            "ray",
            "--ray-address",
            f"{hosts.HEAD}:6379",
            "--host",
            hosts.FRONT,
            "--port",
            "0",
            "--startup-timeout",
            "120",
            "--heartbeat-timeout",
            "2",
            *args,
        )
        deadline = time.monotonic() + 150
        while not (match := _BANNER.search(log.read_text())):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the front did not serve:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.target = f"{match.group(1)}:{match.group(2)}"

    def worker_pids(self) -> dict[int, int]:
        """Each worker's rank-0 pid, from the latest 'ready' line of each."""
        return {int(w): int(p) for w, p in _READY.findall(self.log.read_text())}

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)
