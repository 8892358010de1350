"""How worker processes are started: a small seam (local processes; Ray actors in
ray_launcher.py; tasks of the front's own loop in in_front_launcher.py).

A launcher turns a `WorkerSpec` into a running worker and gives back a handle to watch and
stop it. Workers only need the spec (addresses and engine config), so a launcher that
places them on other hosts (Ray, for instance) can replace `LocalLauncher` without
touching the transport or the front.

A tensor-parallel worker (a spec whose device lists one device per rank) is one process per
rank, started, watched and stopped as one handle: rank 0 talks to the front, the others
follow it through torch.distributed.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Protocol

import msgspec

from cadence.config import ServerConfig, WorkerSpec, cuda_device_count
from cadence.worker import child_environment


class WorkerHandle(Protocol):
    """A started worker."""

    index: int

    def exit_code(self) -> int | None:
        """None while it runs, its exit status once it has stopped."""

    def terminate(self) -> None:
        """Ask it to stop now."""

    def kill(self) -> None:
        """Stop it without asking."""

    def wait(self, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for it to stop; its exit status, or None."""


class Launcher(Protocol):
    worker_host: str
    """The address the front should bind its worker sockets on (tcp); empty: its default."""

    def launch(self, spec: WorkerSpec) -> WorkerHandle:
        """Start a worker for `spec`."""

    def close(self) -> None:
        """Release what the launcher holds, once its workers have stopped (may block)."""


class LocalProcess:
    """A worker running as a child process of the front."""

    def __init__(self, index: int, process: subprocess.Popen) -> None:
        self.index = index
        self.pid = process.pid
        self._process = process

    def exit_code(self) -> int | None:
        return self._process.poll()

    def terminate(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()

    def wait(self, timeout: float) -> int | None:
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class LocalGroup:
    """A tensor-parallel worker: one child process per rank, handled as one worker.

    A group that lost a rank cannot step, so once any rank has stopped the others are
    killed and the group counts as stopped (its exit status is the first non-zero one).
    """

    def __init__(self, index: int, ranks: list[LocalProcess], store_dir: str) -> None:
        self.index = index
        self.ranks = ranks
        self.pid = ranks[0].pid
        """Rank 0's process: the one that talks to the front."""
        self._store_dir = store_dir

    def exit_code(self) -> int | None:
        codes = [r.exit_code() for r in self.ranks]
        if all(c is None for c in codes):
            return None
        for rank in self.ranks:
            rank.kill()
        self._cleanup_if_done()
        return next((c for c in codes if c), next(c for c in codes if c is not None))

    def terminate(self) -> None:
        for rank in self.ranks:
            rank.terminate()

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        codes = [r.wait(max(0.0, deadline - time.monotonic())) for r in self.ranks]
        if any(c is None for c in codes):
            return None
        self._cleanup_if_done()
        return next((c for c in codes if c), 0)

    def _cleanup_if_done(self) -> None:
        if all(r.exit_code() is not None for r in self.ranks):
            shutil.rmtree(self._store_dir, ignore_errors=True)


class LocalLauncher:
    """Starts each worker as `python -m cadence.worker SPEC` on this host (one process per
    rank for a tensor-parallel worker).

    Workers get their own session, so a Ctrl-C at the terminal reaches only the front,
    which then stops them in order; they also die with the front if it is killed
    (PDEATHSIG), and a follower rank dies with it too.
    """

    worker_host = ""

    def close(self) -> None:
        """Nothing to release: the processes are gone."""

    def launch(self, spec: WorkerSpec) -> LocalProcess | LocalGroup:
        devices = spec.device.split(",")
        if len(devices) == 1:
            return LocalProcess(spec.index, self._start(spec))
        # The ranks meet through a file store in a fresh private folder: no port to pick.
        store_dir = tempfile.mkdtemp(prefix="cadence-tp-")
        ranks = []
        for rank, device in enumerate(devices):
            rank_spec = msgspec.structs.replace(
                spec,
                device=device,
                rank=rank,
                group_size=len(devices),
                dist_init=f"file://{store_dir}/store",
            )
            ranks.append(LocalProcess(spec.index, self._start(rank_spec)))
        return LocalGroup(spec.index, ranks, store_dir)

    @staticmethod
    def _start(spec: WorkerSpec) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "cadence.worker", msgspec.json.encode(spec).decode()],
            start_new_session=True,
            env=child_environment(),
        )


_EXTRAS = {
    "torch": ("--engine torch", ("torch", "safetensors", "tokenizers")),
    "transformers": ("--engine transformers", ("torch", "transformers")),
    "ray": ("--launcher ray", ("ray",)),
    "native": ("--grpc-server native", ("pyvoy",)),
    "otel": (
        "--otlp-traces-endpoint",
        ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc"),
    ),
}
"""Each optional extra: the option that needs it and the packages it installs."""


def missing_extra(config: ServerConfig) -> str | None:
    """Why `config` cannot run with the packages installed here (one line naming the missing
    package and the extra to install), or None. Checked before any worker starts, so the
    answer is one line, not a worker's traceback."""
    extras = []
    if config.engine.name in ("torch", "transformers"):
        extras.append(config.engine.name)
    elif config.engine.name == "model" and any("," in d for d in config.devices):
        extras.append("torch")  # the group's ranks meet through torch.distributed
    if config.launcher == "ray":
        extras.append("ray")
    if config.otlp_traces_endpoint:
        extras.append("otel")
    if config.grpc_server == "native":
        extras.append("native")
    for extra in extras:
        option, packages = _EXTRAS[extra]
        if extra == "torch" and config.engine.name == "model":
            option, packages = "--tp with --engine MODULE:CLASS", ("torch",)
        for package in packages:
            if not _installed(package):
                return (
                    f"{option} needs the package {package!r}, which is not installed; "
                    f"install it with: pip install 'cadence[{extra}]'"
                )
    return None


def absent_cards(config: ServerConfig) -> str | None:
    """Why the CUDA cards `config` names cannot be opened on this host (one line), or None.
    Checked with the packages, before any worker starts; Ray's workers run on other hosts."""
    wanted = sorted(
        {
            int(d.partition(":")[2])
            for group in config.devices
            for d in group.split(",")
            if d.startswith("cuda:")
        }
    )
    if not wanted or config.launcher == "ray":
        return None
    if not _installed("torch"):
        return (
            f"--devices cuda:{','.join(map(str, wanted))} needs torch to open the cards, "
            "which is not installed; install it with: pip install 'cadence[torch]'"
        )
    visible = cuda_device_count()
    missing = [i for i in wanted if i >= visible]
    if not missing:
        return None
    has = f"only cuda:0 to cuda:{visible - 1}" if visible else "none"
    return (
        f"--devices names {'a CUDA card' if len(missing) == 1 else 'CUDA cards'} "
        f"{', '.join(f'cuda:{i}' for i in missing)}, but this "
        f"host has {has} visible; use cpu:N, or auto for every visible card"
    )


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def make_launcher(config: ServerConfig) -> Launcher:
    """The launcher `config` names: local processes, or Ray actors (`--launcher ray`).
    Joining a Ray cluster blocks; raises RuntimeError when it cannot."""
    if config.launcher == "ray":
        from cadence.lifecycle.ray_launcher import RayLauncher

        return RayLauncher(config)
    return LocalLauncher()
