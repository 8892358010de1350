"""`--grpc-server native`: Envoy holds nothing another local user can reach.

With hot restart on (Envoy's default), Envoy listens on abstract Unix sockets, which have no
file and so no permissions: any local user could crash it with one datagram, stop it, or have
it hand over the gRPC port's listening socket (and read clients' bearer tokens). Hot restart
also leaves its shared memory in /dev/shm behind.
"""

from __future__ import annotations

import os

import psutil
import pytest

from tests.integration.conftest import start_server

pytestmark = pytest.mark.native
pytest.importorskip("pyvoy", reason="pyvoy is in the test extras (cadence[native])")


def _abstract_unix_sockets(pid: int) -> list[str]:
    """The names of the abstract Unix sockets process `pid` holds (psutil reads them from
    /proc/net/unix, matched against the process's fds; an abstract name starts with NUL,
    shown as '@')."""
    names = []
    for sock in psutil.Process(pid).net_connections(kind="unix"):
        for address in (sock.laddr, sock.raddr):
            if address and address[0] in ("\0", "@"):
                names.append(address)
    return names


def _envoys(server) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.pid).children(recursive=True) if p.name() == "envoy"]


@pytest.mark.parametrize("fronts", ["1", "2"])
def test_envoy_holds_no_abstract_socket_and_leaves_no_shared_memory(fronts: str) -> None:
    with start_server(
        "--grpc-server",
        "native",
        "--devices",
        "cpu:1",
        "--step-ms",
        "5",
        "--fronts",
        fronts,
        "--http-port",
        "0",
        "--metrics-port",
        "0",
    ) as server:
        envoys = _envoys(server)
        assert len(envoys) == int(fronts), envoys
        abstract = {envoy.pid: _abstract_unix_sockets(envoy.pid) for envoy in envoys}
        shared = {
            m.path
            for envoy in envoys
            for m in envoy.memory_maps()
            if m.path.startswith("/dev/shm/envoy_shared_memory_")
        }
        command_lines = [envoy.cmdline() for envoy in envoys]
    assert server.process.returncode == 0
    # Hot restart's shared memory, named by the Envoy that mapped it (other servers on the
    # host may have their own).
    left = sorted(path for path in shared if os.path.exists(path))
    assert not left, f"Envoy left its shared memory behind: {left}"
    assert not shared, f"Envoy made shared memory for a hot restart: {sorted(shared)}"
    assert not any(abstract.values()), (
        f"Envoy holds abstract Unix sockets, reachable by any local user: {abstract}"
    )
    # What the command line asks for, so that an Envoy whose default changes is caught too.
    assert all("--disable-hot-restart" in line for line in command_lines)
