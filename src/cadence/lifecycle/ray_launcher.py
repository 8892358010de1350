"""Workers as Ray actors (`cadence serve --launcher ray`): Ray places and supervises the
processes; requests and tokens still go over our own ZeroMQ sockets (tcp, CURVE), never
through Ray's object store.

One placement group holds one bundle per card (`{"GPU": 1}` on CUDA, `{"card": 1}` on CPU
hosts, a custom resource each node declares with `ray start --resources '{"card": N}'`).
Each rank of each worker is one actor with `num_cpus=0` in its own bundle, running the same
`run_worker` entry point as a local worker process. The front is the Ray driver: the actors
are not detached, so they die with it, and each also exits when the front's heartbeat
stops. Ray does not restart them (`max_restarts=0`): the front's supervisor does, with its
own back-off and health, in the same bundle.

A tensor-parallel worker's ranks meet through a TCP store on rank 0's node (its Ray IP and
a port free there); gloo and NCCL use the network interface that carries each node's Ray
IP, or `--dist-ifname`.

A signal to the whole process group (or cgroup: systemd's `KillMode=control-group`) reaches
the Ray instance the front started as well as the front: its GCS and raylet begin their own
shutdown, and Ray's calls that need them block for minutes (`remove_placement_group` retries).
So the launcher's `close` gives Ray a few seconds; past them it kills, by pid, its actors on
this host and whatever is left of the Ray instance it started, and skips Ray's shutdown.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import msgspec

from cadence.config import ServerConfig, WorkerSpec
from cadence.wording import counted

log = logging.getLogger("cadence.ray")

CARD = "card"
"""The custom resource a CPU host declares per worker rank it can hold."""
_DIED = -9
"""Exit status reported for an actor that Ray saw die (killed, or its node lost)."""
_CLOSE_TIMEOUT_S = 4.0
"""How long leaving Ray may take (it takes under 2 s when Ray's processes are healthy)."""


class WorkerActor:
    """One rank of one worker, inside a Ray worker process on the node Ray chose."""

    def where(self) -> tuple[str, int, int]:
        """This actor's node IP, its pid, and a TCP port free on that IP (for a rendezvous)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((ip, 0))
            port = probe.getsockname()[1]
        return ip, os.getpid(), port

    def run(self, spec_json: bytes) -> int:
        """Run the worker until the front shuts it down; 0 then."""
        import ray

        from cadence.worker.process import run_worker

        spec = msgspec.json.decode(spec_json, type=WorkerSpec)
        ifname = spec.dist_ifname or _interface_of(ray.util.get_node_ip_address())
        if ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
        if spec.device.startswith("cuda"):
            # Ray gives the actor its card as the only visible one.
            spec = msgspec.structs.replace(spec, device="cuda:0")
        run_worker(spec)
        return 0


def _check_reachable(address: str) -> None:
    """Fail fast on a Ray address nothing listens on (ray.init retries it for minutes)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # `auto` or a scheme Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise RuntimeError(
            f"cannot reach the Ray cluster at {address}: {exc}; is `ray start "
            "--head` running there, and is --ray-address right?"
        ) from None


def _interface_of(ip: str) -> str:
    """The network interface that holds `ip` (empty when none does)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    return ""


class RayWorker:
    """A `WorkerHandle` for one worker (all its ranks) as Ray actors.

    Starting does not block the front's event loop: a thread creates the actors, finds the
    rendezvous and starts them; until then the worker simply counts as running.
    """

    def __init__(self, launcher: RayLauncher, spec: WorkerSpec) -> None:
        self.index = spec.index
        self.pid = 0
        """Rank 0's process id, once started (on whichever node it runs)."""
        self.node_ips: list[str] = []
        """Each rank's node IP, once started."""
        self._actors: list = []
        self._refs: list = []
        self._failed: str | None = None
        self._started = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(
            target=self._start,
            args=(launcher, spec),
            daemon=True,
            name=f"cadence-ray-start-{spec.index}",
        ).start()

    def _start(self, launcher: RayLauncher, spec: WorkerSpec) -> None:
        import ray

        try:
            devices = spec.device.split(",")
            for rank, device in enumerate(devices):
                with self._lock:
                    if self._stopped:
                        return
                    self._actors.append(launcher.actor(spec.index, rank, device))
            places = ray.get([actor.where.remote() for actor in self._actors])
            self.node_ips = [ip for ip, _, _ in places]
            self.pid = places[0][1]
            launcher.local_pids.update(pid for ip, pid, _ in places if ip == launcher.worker_host)
            ip, _, port = places[0]
            dist_init = f"tcp://{ip}:{port}" if len(devices) > 1 else ""
            with self._lock:
                if self._stopped:
                    return
                for rank, (actor, device) in enumerate(zip(self._actors, devices)):
                    rank_spec = msgspec.structs.replace(
                        spec,
                        device=device,
                        rank=rank,
                        group_size=len(devices),
                        dist_init=dist_init,
                    )
                    self._refs.append(actor.run.remote(msgspec.json.encode(rank_spec)))
            log.info("worker %d placed on %s", spec.index, ", ".join(self.node_ips))
        except Exception as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            log.error("worker %d could not be started on Ray: %s", spec.index, self._failed)
        finally:
            self._started.set()

    def exit_code(self) -> int | None:
        """None while every rank runs; once any rank has stopped, the others are killed and
        the first non-zero status is returned."""
        import ray

        if self._failed is not None:
            return 1
        if not self._started.is_set() or not self._refs:
            return None
        done, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        if not done:
            return None
        self.kill()
        return next((c for c in map(_status, done) if c), 0)

    def terminate(self) -> None:
        """Ray cannot ask an actor to stop; the front's Shutdown message already has."""
        self.kill()

    def kill(self) -> None:
        import ray

        with self._lock:
            self._stopped = True
            actors = list(self._actors)
        for actor in actors:
            ray.kill(actor, no_restart=True)

    def wait(self, timeout: float) -> int | None:
        import ray

        if not self._started.wait(timeout):
            return None
        if self._failed is not None:
            return 1
        if not self._refs:
            return 0
        done, pending = ray.wait(self._refs, num_returns=len(self._refs), timeout=timeout)
        if pending:
            return None
        return next((c for c in map(_status, done) if c), 0)


def _status(ref) -> int:
    """A finished rank's exit status: 0 after a shutdown, -9 if Ray saw the actor die."""
    import ray

    try:
        return int(ray.get(ref))
    except ray.exceptions.RayActorError:
        return _DIED
    except Exception:
        return 1


class RayLauncher:
    """Connects the front to a Ray cluster (or starts one on this host) and reserves one
    bundle per card for all of `config`'s workers."""

    def __init__(self, config: ServerConfig) -> None:
        try:
            import ray
        except ImportError as exc:
            raise RuntimeError("--launcher ray needs Ray: pip install 'cadence[ray]'") from exc
        from ray.util.placement_group import placement_group

        ranks = [device for worker in config.devices for device in worker.split(",")]
        self._gpu = [device.startswith("cuda") for device in ranks]
        if config.ray_address:
            _check_reachable(config.ray_address)
        # ray.init replaces the SIGTERM handler with one that exits at once; the front's own
        # (a drain) must stay.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if config.ray_address:
                ray.init(address=config.ray_address, namespace="cadence", log_to_driver=True)
            else:
                # A Ray instance of our own, with a card per rank. `local`, because without an
                # address ray.init joins whatever cluster /tmp/ray/ray_current_cluster names,
                # even one long gone.
                ray.init(
                    address="local",
                    namespace="cadence",
                    include_dashboard=False,
                    log_to_driver=True,
                    resources={CARD: sum(not g for g in self._gpu)},
                )
        except (ConnectionError, ValueError) as exc:
            where = config.ray_address or "a new local instance"
            raise RuntimeError(
                f"cannot join the Ray cluster at {where}: {exc}; check "
                "--ray-address and RAY_AUTH_TOKEN"
            ) from exc
        finally:
            if threading.current_thread() is threading.main_thread():
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)
        self.worker_host = ray.util.get_node_ip_address()
        """The address the front binds its worker sockets on: this node's Ray IP."""
        self._offsets = []
        offset = 0
        for worker in config.devices:
            self._offsets.append(offset)
            offset += worker.count(",") + 1
        bundles = [{"GPU": 1} if gpu else {CARD: 1} for gpu in self._gpu]
        self._group = placement_group(bundles, strategy="PACK", name="")
        try:
            ray.get(self._group.ready(), timeout=config.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self._group)
            ray.shutdown()
            raise RuntimeError(
                f"the Ray cluster has no room for {counted(len(bundles), 'worker rank')} "
                f"({sum(self._gpu)} GPU, {len(bundles) - sum(self._gpu)} '{CARD}') within "
                f"{config.startup_timeout_s:.0f} s; start nodes with `ray start --resources "
                f"'{{\"{CARD}\": N}}'` (CPU) or with GPUs, or ask for fewer --devices"
            ) from None
        self._actor_class = ray.remote(WorkerActor)
        self.local_pids: set[int] = set()
        """Processes of this launcher's actors on this host."""
        self._own = None if config.ray_address else ray._private.worker._global_node
        """The Ray instance this front started (None: a cluster it joined)."""

    def actor(self, worker: int, rank: int, device: str):
        """A new actor for one rank of `worker`, in that rank's bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._offsets[worker] + rank
        resources = {} if self._gpu[bundle] else {CARD: 1}
        return self._actor_class.options(
            num_cpus=0,
            num_gpus=1 if self._gpu[bundle] else 0,
            resources=resources,
            max_restarts=0,
            name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=bundle
            ),
        ).remote()

    def launch(self, spec: WorkerSpec) -> RayWorker:
        """Start `spec`'s worker (one actor per rank); returns at once."""
        return RayWorker(self, spec)

    def kill_local(self) -> None:
        """SIGKILL this launcher's actors on this host and what is left of the Ray instance it
        started (with every process its raylet started): Ray can no longer stop them."""
        import psutil

        pids = set(self.local_pids)
        self.local_pids.clear()
        processes: list[subprocess.Popen] = []
        if self._own is not None:
            for infos in self._own.all_processes.values():
                for info in infos:
                    processes.append(info.process)
                    try:
                        pids.update(
                            child.pid
                            for child in psutil.Process(info.process.pid).children(recursive=True)
                        )
                    except psutil.Error:
                        pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    def close(self) -> None:
        """Release the cards and leave the cluster (a Ray instance of our own stops), or, when
        Ray does not answer within a few seconds, stop what is left of it here by pid."""
        import ray

        done = threading.Event()

        def release() -> None:
            try:
                if self._own is None:  # a cluster we joined: give its cards back
                    ray.util.remove_placement_group(self._group)
                ray.shutdown()  # our own instance: its processes stop, the group with them
            finally:
                done.set()

        # A daemon thread: one stuck in Ray's calls must not hold the front's exit.
        threading.Thread(target=release, daemon=True, name="cadence-ray-close").start()
        if not done.wait(_CLOSE_TIMEOUT_S):
            log.warning(
                "Ray did not shut down within %.0f s (was it stopped from outside, by a "
                "signal to the whole process group or cgroup?); killing what is left "
                "of it on this host",
                _CLOSE_TIMEOUT_S,
            )
            self.kill_local()
            # Ray's own exit hooks would wait for it again, and its threads, stuck in calls to
            # processes that are gone, crash the interpreter's teardown: leave at once.
            atexit.unregister(ray.shutdown)
            atexit.register(_exit_now)


def _exit_now() -> None:
    """The last exit hook once Ray was abandoned: flush, then exit without the teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
