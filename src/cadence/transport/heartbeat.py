"""A worker's side of the heartbeat (the front's is `FrontChannel.beat`, on a PUB socket)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from cadence.config import WorkerSpec
from cadence.transport.messages import Heartbeat
from cadence.transport.worker_channel import worker_context


class WorkerHeartbeat(threading.Thread):
    """A worker's side of the heartbeat, on its own thread and sockets so that a long engine
    step delays nothing: every `heartbeat_interval_s` it tells the front this worker is alive,
    and when it has heard nothing from the front for `heartbeat_timeout_s` it calls `on_lost`
    (the worker exits). A tensor-parallel follower only listens (`send=False`).

    Each beat also carries `stalled()`: how long the worker's step loop has had something to
    step without finishing a step. Read here, on its own thread, it is seen while the loop is
    stuck inside a step, and front 0 judges the hang whichever front the work came from.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        on_lost: Callable[[], None],
        *,
        send: bool = True,
        stalled: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(name="cadence-heartbeat", daemon=True)
        self._spec = spec
        self._on_lost = on_lost
        self._send = send
        self._stalled = stalled or (lambda: 0)
        self._stop = threading.Event()

    def run(self) -> None:
        spec = self._spec
        context = worker_context(spec)
        listen = context.socket(zmq.SUB)
        listen.setsockopt(zmq.LINGER, 0)
        listen.setsockopt(zmq.SUBSCRIBE, b"")
        listen.connect(spec.heartbeat_address)
        tell = None
        if self._send:
            tell = context.socket(zmq.PUSH)
            tell.setsockopt(zmq.LINGER, 0)
            tell.setsockopt(zmq.SNDHWM, 4)
            tell.connect(spec.output_address)
        encode, worker, stalled = msgspec.msgpack.encode, spec.index, self._stalled
        interval, timeout = spec.heartbeat_interval_s, spec.heartbeat_timeout_s
        heard = time.monotonic()
        try:
            while not self._stop.is_set():
                if tell is not None:
                    with contextlib.suppress(zmq.Again):
                        tell.send(
                            encode(Heartbeat(worker, time.monotonic_ns(), stalled())), zmq.NOBLOCK
                        )
                if listen.poll(int(interval * 1e3)):
                    while True:
                        try:
                            listen.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    heard = time.monotonic()
                elif time.monotonic() - heard > timeout and not self._stop.is_set():
                    self._on_lost()
                    return
        finally:
            listen.close(linger=0)
            if tell is not None:
                tell.close(linger=0)
            context.term()

    def stop(self) -> None:
        """Stop beating (a worker shutting down in order must not be taken for lost)."""
        self._stop.set()
