"""A worker's end of the transport: `WorkerChannel` reads its inputs and sends its outputs to
its one front (`--fronts N`: worker_to_fronts.py's subclass, to every front)."""

from __future__ import annotations

import msgspec
import zmq

from cadence.config import WorkerSpec
from cadence.transport.messages import WorkerInput, WorkerOutput
from cadence.transport.sockets import OUTPUT_HWM


class WorkerChannel:
    """A worker's end: read inputs (blocking only when idle), send outputs."""

    fronts = 1
    """Fronts this worker serves (`--fronts N`: worker_to_fronts.MultiFrontChannel)."""

    def __init__(
        self,
        input_address: str,
        output_address: str,
        output_hwm: int = OUTPUT_HWM,
        *,
        curve: WorkerSpec | None = None,
    ) -> None:
        # output_hwm 0 (no limit) is for a worker inside the front: blocking on its own
        # event loop's reader would deadlock.
        self._output_hwm = output_hwm
        self._context = worker_context(curve)
        self._input = self._context.socket(zmq.PULL)
        self._input.setsockopt(zmq.RCVHWM, 0)
        self._input.connect(input_address)
        self._output = self._connect_output(output_address)
        self._poller = zmq.Poller()
        self._poller.register(self._input, zmq.POLLIN)
        self._decode = msgspec.msgpack.Decoder(WorkerInput).decode
        self._encode = msgspec.msgpack.Encoder().encode
        self.newly_gone: list[int] = []
        """Fronts reported gone since the caller last emptied this list (`--fronts N`)."""

    def _connect_output(self, address: str) -> zmq.Socket:
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, self._output_hwm)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(address)
        return sock

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


def worker_context(spec: WorkerSpec | None) -> zmq.Context:
    """A ZeroMQ context whose sockets are CURVE clients of the front when `spec` says so."""
    context = zmq.Context()
    if spec is not None and spec.curve_server_key:
        for option, value in (
            (zmq.CURVE_SERVERKEY, spec.curve_server_key),
            (zmq.CURVE_PUBLICKEY, spec.curve_public_key),
            (zmq.CURVE_SECRETKEY, spec.curve_secret_key),
        ):
            context.setsockopt(option, value.encode())
    return context
