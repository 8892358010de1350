"""Where the front's and workers' ZeroMQ sockets are, how much each queues, and their cleanup.

The front binds everything and workers connect, so a worker can run wherever it can reach
the front's addresses (ipc:// on one host, tcp:// across hosts). Each worker has its own
input socket (PUSH at the front, PULL at the worker); all workers share one output socket
(PUSH at each worker, one PULL at the front), so the front reads every step from one place;
a PUB socket beside it carries the front's heartbeat. `--fronts N` (worker_to_fronts.py) gives
each front its own set.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

OUTPUT_HWM = 64
"""Step messages each side of the output socket holds at most. A worker more than about
2 x OUTPUT_HWM steps ahead of the front blocks on its next send: when the front as a whole
cannot keep up, the engines wait rather than fill the front's memory. A slow client never
causes this; its tokens merge in its own buffer."""


def local_addresses(workers: int, transport: str, host: str = "127.0.0.1") -> tuple[list[str], str]:
    """Addresses for `workers` input sockets and the output socket.

    `ipc` uses a fresh private directory; `tcp` asks the OS for ports when binding
    (`tcp://host:*`), so the bound address must be read back from the socket.
    """
    if transport == "ipc":
        base = tempfile.mkdtemp(prefix="cadence-")
        return [f"ipc://{base}/in-{i}" for i in range(workers)], f"ipc://{base}/out"
    if transport == "tcp":
        return [f"tcp://{host}:*"] * workers, f"tcp://{host}:*"
    raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")


def front_addresses(base: str, front: int, workers: int) -> tuple[list[str], str]:
    """`--fronts N` (ipc only): front `front`'s input sockets (one per worker) and output
    socket, in the folder `base` that front 0 created; every front and worker can derive them."""
    return ([f"ipc://{base}/f{front}-in-{i}" for i in range(workers)], f"ipc://{base}/f{front}-out")


def heartbeat_address(output_address: str) -> str:
    """Where a front binds its heartbeat: beside its output socket, named after it (ipc), so
    that each front of `--fronts N` has its own (a second bind of one ipc path takes the file
    over, and a worker started later would connect to a front that does not beat), or on
    the same host (tcp)."""
    if output_address.startswith("ipc://"):
        return f"{output_address}-hb"
    return output_address.rsplit(":", 1)[0] + ":*"


def ipc_files(addresses: list[str]) -> dict[str, tuple[int, int]]:
    """The (device, inode) of the socket file of each ipc address among `addresses`, as bound
    now: what `remove_ipc_sockets(..., bound=)` removes later, and nothing that replaced it."""
    files = {}
    for address in addresses:
        if address.startswith("ipc://"):
            with contextlib.suppress(OSError):
                stat = os.stat(address[len("ipc://") :])
                files[address] = (stat.st_dev, stat.st_ino)
    return files


def remove_ipc_sockets(
    addresses: list[str], bound: dict[str, tuple[int, int]] | None = None
) -> None:
    """Unlink the socket files of the ipc addresses among `addresses`, then their folders
    once empty (a folder that still holds another's sockets stays).

    `bound` (from `ipc_files`): only files that are still the ones this process bound. With
    `--fronts N` a restarted front binds its predecessor's paths; the predecessor's clean-up,
    if it comes later, must not take the replacement's sockets (the workers could not
    reconnect to it)."""
    folders = set()
    for address in addresses:
        if address.startswith("ipc://"):
            path = address[len("ipc://") :]
            folders.add(os.path.dirname(path))
            if bound is not None:
                try:
                    stat = os.stat(path)
                except OSError:
                    continue
                if bound.get(address) != (stat.st_dev, stat.st_ino):
                    continue  # another's now
            with contextlib.suppress(OSError):
                os.unlink(path)
    for folder in folders:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
