"""ZeroMQ sockets between the front and its workers.

The front binds everything and workers connect, so a worker can run wherever it can reach
the front's addresses (ipc:// on one host, tcp:// across hosts). Each worker has its own
input socket (PUSH at the front, PULL at the worker); all workers share one output socket
(PUSH at each worker, one PULL at the front), so the front reads every step from one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable

import msgspec
import zmq

from cadence.transport.messages import (
    AddRequest,
    Shutdown,
    WorkerInput,
    WorkerInputs,
    WorkerOutput,
)

log = logging.getLogger("cadence.transport")

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


class WorkerLink:
    """The front's sending end to one worker.

    Adds and aborts made during one event-loop tick go out as one `WorkerInputs` message,
    so a burst of new requests costs one send, not one per request.
    """

    def __init__(self, socket: zmq.Socket, loop: asyncio.AbstractEventLoop) -> None:
        self._socket = socket
        self._loop = loop
        self._adds: list[AddRequest] = []
        self._aborts: list[int] = []
        self._pauses: list[int] = []
        self._resumes: list[int] = []
        self._flush_scheduled = False
        self._encode = msgspec.msgpack.Encoder().encode

    def add(self, request: AddRequest) -> None:
        self._adds.append(request)
        self._schedule()

    def abort(self, seq_id: int) -> None:
        self._aborts.append(seq_id)
        self._schedule()

    def pause(self, seq_id: int) -> None:
        self._pauses.append(seq_id)
        self._schedule()

    def resume(self, seq_id: int) -> None:
        self._resumes.append(seq_id)
        self._schedule()

    def shutdown(self) -> None:
        self.flush()
        try:
            self._socket.send(self._encode(Shutdown()), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the worker is gone already

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if self._adds or self._aborts or self._pauses or self._resumes:
            message = WorkerInputs(self._adds, self._aborts, self._pauses, self._resumes)
            self._adds, self._aborts, self._pauses, self._resumes = [], [], [], []
            # Never blocks: the input socket has no high-water mark and admission bounds
            # how much can be outstanding. It fails only when no worker is connected,
            # i.e. the worker died; the front's monitor fails that worker's streams.
            try:
                self._socket.send(self._encode(message), zmq.NOBLOCK)
            except zmq.Again:
                pass


class FrontChannel:
    """All of the front's sockets: one `WorkerLink` per worker and the shared output socket."""

    def __init__(self, input_addresses: list[str], output_address: str) -> None:
        self._context = zmq.Context()
        self._inputs: list[zmq.Socket] = []
        self.input_addresses: list[str] = []
        for address in input_addresses:
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            self._inputs.append(sock)
            self.input_addresses.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, OUTPUT_HWM)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        self.output_address = self._output.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decode = msgspec.msgpack.Decoder(WorkerOutput).decode
        self._stop_reading: Callable[[], None] | None = None

    def links(self, loop: asyncio.AbstractEventLoop) -> list[WorkerLink]:
        return [WorkerLink(sock, loop) for sock in self._inputs]

    def start_reading(self, loop: asyncio.AbstractEventLoop,
                      handle: Callable[[WorkerOutput, int], None]) -> None:
        """From now on, hand every worker message to `handle` with the time it was read.

        The event loop watches the socket's file descriptor directly (no future per read);
        ZeroMQ signals it edge-triggered, so each wake-up drains every waiting message.
        """
        sock = self._output
        recv = sock.recv
        decode = self._decode
        monotonic_ns = time.monotonic_ns
        pollin = zmq.POLLIN
        events = zmq.EVENTS

        def on_readable() -> None:
            while sock.getsockopt(events) & pollin:
                frame = recv()
                try:
                    handle(decode(frame), monotonic_ns())
                except Exception:
                    # Keep draining: an edge-triggered socket left with unread messages
                    # would never wake the loop again, and every stream would stall.
                    log.exception("dropped a worker message that could not be handled")

        fd = sock.getsockopt(zmq.FD)
        loop.add_reader(fd, on_readable)
        first = loop.call_soon(on_readable)  # messages that arrived before the reader was added

        def stop_reading() -> None:
            first.cancel()
            loop.remove_reader(fd)

        self._stop_reading = stop_reading

    def close(self) -> None:
        if self._stop_reading is not None:
            self._stop_reading()
        for sock in self._inputs:
            sock.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        folders = set()
        for address in [*self.input_addresses, self.output_address]:
            if address.startswith("ipc://"):
                path = address[len("ipc://"):]
                folders.add(os.path.dirname(path))
                with contextlib.suppress(OSError):
                    os.unlink(path)
        for folder in folders:
            with contextlib.suppress(OSError):
                os.rmdir(folder)


class WorkerChannel:
    """A worker's end: read inputs (blocking only when idle), send outputs."""

    def __init__(self, input_address: str, output_address: str,
                 output_hwm: int = OUTPUT_HWM) -> None:
        # output_hwm 0 (no limit) is for a worker inside the front: blocking on its own
        # event loop's reader would deadlock.
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PULL)
        self._input.setsockopt(zmq.RCVHWM, 0)
        self._input.connect(input_address)
        self._output = self._context.socket(zmq.PUSH)
        self._output.setsockopt(zmq.SNDHWM, output_hwm)
        self._output.setsockopt(zmq.LINGER, 1000)
        self._output.connect(output_address)
        self._poller = zmq.Poller()
        self._poller.register(self._input, zmq.POLLIN)
        self._decode = msgspec.msgpack.Decoder(WorkerInput).decode
        self._encode = msgspec.msgpack.Encoder().encode

    @property
    def input_fd(self) -> int:
        """The input socket's file descriptor, for an event loop's `add_reader`. ZeroMQ
        signals it edge-triggered: on each wake-up call `receive(0)`, which drains every message."""
        return self._input.getsockopt(zmq.FD)

    def receive(self, timeout_ms: int | None) -> list[WorkerInput]:
        """Every waiting input; waits up to `timeout_ms` for the first (None: forever, 0: not)."""
        messages: list[WorkerInput] = []
        if timeout_ms != 0 and not self._poller.poll(timeout_ms):
            return messages
        while True:
            try:
                messages.append(self._decode(self._input.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    def send(self, message: WorkerOutput) -> None:
        self._output.send(self._encode(message))

    def close(self) -> None:
        self._input.close(linger=0)
        self._output.close()
        self._context.term()
