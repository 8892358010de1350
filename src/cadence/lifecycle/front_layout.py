"""Where one front stands among `--fronts N`: the one object that answers every question whose
answer differs between a lone front, front 0 (which launches the workers and fronts 1..N-1)
and a child front, so that the server's start reads the same for all three.

With N > 1 every front binds its own worker sockets in front 0's private folder, shares one
admission count, names itself in each stream's initial metadata, and a child front opens the
shared port only once the workers are connected to it (a connection the kernel gives it never
meets a front still starting).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from cadence.config import ServerConfig
from cadence.core.generation import sequence_ids
from cadence.router.admission import AdmissionGate, SharedAdmissionGate
from cadence.transport.front_channel import FrontChannel
from cadence.transport.sockets import front_addresses, local_addresses


class FrontLayout:
    """Front `front` of `config.fronts`; `base` is front 0's private folder (a child front is
    given it; front 0 creates it when it binds)."""

    def __init__(
        self, config: ServerConfig, front: int = 0, base: str | None = None, generation: int = 0
    ) -> None:
        self._config = config
        self.front = front
        self.fronts = config.fronts
        self.base = base
        self._generation = generation
        self.gate: AdmissionGate | SharedAdmissionGate | None = None

    @property
    def launches_workers(self) -> bool:
        """Front 0 (or the only front) launches and supervises the workers; a child watches."""
        return self.front == 0

    @property
    def launches_fronts(self) -> bool:
        """Front 0 of several starts, watches and drains the others."""
        return self.front == 0 and self.fronts > 1

    def sequence_ids(self) -> Iterator[int]:
        return sequence_ids(self.front, self.fronts, self._generation)

    def bind(
        self,
        workers: int,
        worker_host: str,
        stack: contextlib.AsyncExitStack,
    ) -> tuple[FrontChannel, AdmissionGate | SharedAdmissionGate]:
        """This front's sockets, and its admission gate (shared by all fronts with N > 1)."""
        config = self._config
        if self.fronts == 1:
            channel = FrontChannel(
                *local_addresses(workers, config.transport, worker_host),
                secure=config.transport == "tcp",
            )
            self.gate = AdmissionGate(config.max_concurrent)
            return channel, self.gate
        if self.front == 0:
            self.base = tempfile.mkdtemp(prefix="cadence-")
            stack.callback(shutil.rmtree, self.base, ignore_errors=True)
        assert self.base is not None  # front 0 made it just above; a child front is given it
        channel = FrontChannel(*front_addresses(self.base, self.front, workers))
        self.gate = SharedAdmissionGate(
            f"{self.base}/admission", self.front, self.fronts, config.max_concurrent
        )
        return channel, self.gate

    def other_fronts_sockets(self, workers: int) -> tuple[list[list[str]], list[str]]:
        """What each worker connects to beyond front 0's sockets: every other front's input
        socket for it, and every other front's output socket."""
        extra_inputs: list[list[str]] = [[] for _ in range(workers)]
        front_outputs = []
        for k in range(1, self.fronts):
            assert self.base is not None  # front 0 made it when it bound, as fronts > 1
            inputs, output = front_addresses(self.base, k, workers)
            front_outputs.append(output)
            for i in range(workers):
                extra_inputs[i].append(inputs[i])
        return extra_inputs, front_outputs

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Initial metadata (HTTP: headers) naming the front that serves a stream; None with
        one front."""
        if self.fronts == 1:
            return None
        return (("cadence-front", str(self.front)), ("cadence-front-pid", str(os.getpid())))

    def write_ready_file(self, metrics_port: int | None) -> None:
        """A child front tells front 0 it serves (the file holds its metrics port, 0: none)."""
        path = f"{self.base}/f{self.front}-ready"
        with open(path + ".tmp", "w") as f:
            f.write(str(metrics_port or 0))
        os.replace(path + ".tmp", path)
