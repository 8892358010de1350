"""The front's end of the transport: one `WorkerLink` per worker to send on, and the
`FrontChannel` that owns the front's sockets and reads every worker's output."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import cast

import msgspec
import zmq

from cadence.transport.messages import (
    Heartbeat,
    Shutdown,
    StateImport,
    WorkerInputs,
    WorkerOutput,
)
from cadence.transport.sockets import (
    OUTPUT_HWM,
    heartbeat_address,
    ipc_files,
    remove_ipc_sockets,
)
from cadence.vocabulary import AddRequest

log = logging.getLogger("cadence.transport")

_encode_add = msgspec.msgpack.Encoder().encode


def encode_add(request: AddRequest) -> msgspec.Raw:
    """One request's message, encoded on its own before it joins a tick's batch, so that a
    value msgpack cannot hold (an integer wider than 64 bits) fails that request alone
    (ValueError) and never the batch, and so every request sent with it."""
    try:
        return msgspec.Raw(_encode_add(request))
    except OverflowError as exc:
        raise ValueError(f"a field of the request does not fit in 64 bits ({exc})") from None


class WorkerLink:
    """The front's sending end to one worker.

    Adds and aborts made during one event-loop tick go out as one `WorkerInputs` message,
    so a burst of new requests costs one send, not one per request. Each add arrives already
    encoded (`encode_add`): the batch holds only bytes and the front's own integers, so its
    encoding cannot fail.
    """

    def __init__(self, socket: zmq.Socket, loop: asyncio.AbstractEventLoop) -> None:
        self._socket = socket
        self._loop = loop
        self._adds: list[msgspec.Raw] = []
        self._aborts: list[int] = []
        self._pauses: list[int] = []
        self._resumes: list[int] = []
        self._imports: list[StateImport] = []
        self.paused = 0
        """Sequences paused now (the stream lowers it when the pause ends): a worker whose
        every request is paused has nothing to step, and is not hung."""
        self._flush_scheduled = False
        self._encode = msgspec.msgpack.Encoder().encode

    def add(self, request: msgspec.Raw) -> None:
        """Send one request (`encode_add`'s result) with this tick's batch."""
        self._adds.append(request)
        self._schedule()

    def add_import(self, handed: StateImport) -> None:
        """Send a decode worker a sequence to go on with (its `request` an `encode_add`
        frame, as an add's), with this tick's batch."""
        self._imports.append(handed)
        self._schedule()

    def abort(self, seq_id: int) -> None:
        self._aborts.append(seq_id)
        self._schedule()

    def pause(self, seq_id: int) -> None:
        self.paused += 1
        self._pauses.append(seq_id)
        self._schedule()

    def resume(self, seq_id: int) -> None:
        self._resumes.append(seq_id)
        self._schedule()

    def connected(self) -> bool:
        """Whether the worker's end is connected, so that a send is not dropped (probes with
        an empty message). A front that binds after its workers connected uses this before
        it routes to them: until the worker reconnects, a send would be lost."""
        try:
            self._socket.send(self._encode(WorkerInputs([], [])), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def front_gone(self, front: int) -> None:
        """`--fronts N`: tell the worker that front `front` died (drop its sequences)."""
        try:
            self._socket.send(self._encode(WorkerInputs([], [], gone_fronts=[front])), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def front_back(self, front: int) -> None:
        """`--fronts N`: tell the worker that front `front` was restarted (send to it again)."""
        try:
            self._socket.send(self._encode(WorkerInputs([], [], back_fronts=[front])), zmq.NOBLOCK)
        except zmq.Again:
            pass

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
        if self._adds or self._aborts or self._pauses or self._resumes or self._imports:
            # The worker decodes `adds` as AddRequests: the raw frames are spliced in as is.
            message = WorkerInputs(
                self._adds,  # type: ignore[arg-type]  # Raw: encoded AddRequests
                self._aborts,
                self._pauses,
                self._resumes,
                imports=self._imports,
            )
            self._adds, self._aborts, self._pauses, self._resumes = [], [], [], []
            self._imports = []
            # Never blocks: the input socket has no high-water mark and admission bounds
            # how much can be outstanding. It fails only when no worker is connected,
            # i.e. the worker died; the front's monitor fails that worker's streams.
            try:
                self._socket.send(self._encode(message), zmq.NOBLOCK)
            except zmq.Again:
                pass


class FrontChannel:
    """All of the front's sockets: one `WorkerLink` per worker, the shared output socket, and
    the heartbeat (PUB) socket.

    `secure` (what tcp uses) makes every socket a CURVE server: a peer needs the front's
    public key, which only the specs of the server's own workers carry, and all traffic is
    encrypted. ipc sockets live in a private folder instead.
    """

    def __init__(
        self, input_addresses: list[str], output_address: str, *, secure: bool = False
    ) -> None:
        self._context = zmq.Context()
        self.curve_server_key = ""
        self.curve_client_keys = ("", "")
        """(public, secret) Z85 key pair for this front's workers; empty unless secure."""
        if secure:
            public, secret = zmq.curve_keypair()
            self.curve_server_key = public.decode()
            client_public, client_secret = zmq.curve_keypair()
            self.curve_client_keys = (client_public.decode(), client_secret.decode())
            for option, value in (
                (zmq.CURVE_SERVER, 1),
                (zmq.CURVE_SECRETKEY, secret),
                (zmq.CURVE_PUBLICKEY, public),
            ):
                self._context.setsockopt(option, value)
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
        self._heartbeat = self._context.socket(zmq.PUB)
        self._heartbeat.setsockopt(zmq.LINGER, 0)
        self._heartbeat.bind(heartbeat_address(output_address))
        self.heartbeat_address = self._heartbeat.getsockopt_string(zmq.LAST_ENDPOINT)
        self._files = ipc_files(self._addresses())
        """The socket files this channel bound (`unlink` removes those, no replacement's)."""
        self._beat = msgspec.msgpack.encode(Heartbeat())
        self._decode = msgspec.msgpack.Decoder(WorkerOutput).decode
        self._stop_reading: Callable[[], None] | None = None

    def beat(self) -> None:
        """Tell every worker the front is alive (never blocks: PUB drops when full)."""
        self._heartbeat.send(self._beat, zmq.NOBLOCK)

    def links(self, loop: asyncio.AbstractEventLoop) -> list[WorkerLink]:
        return [WorkerLink(sock, loop) for sock in self._inputs]

    def start_reading(
        self, loop: asyncio.AbstractEventLoop, handle: Callable[[WorkerOutput, int], None]
    ) -> None:
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
            while cast(int, sock.getsockopt(events)) & pollin:  # ZMQ_EVENTS is an int option
                frame = recv()
                try:
                    handle(decode(frame), monotonic_ns())
                except Exception:
                    # Keep draining: an edge-triggered socket left with unread messages
                    # would never wake the loop again, and every stream would stall.
                    log.exception("dropped a worker message that could not be handled")

        fd = sock.fileno()  # ZMQ_FD
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
        self._heartbeat.close(linger=0)
        self._context.term()
        self.unlink()

    def _addresses(self) -> list[str]:
        return [*self.input_addresses, self.output_address, self.heartbeat_address]

    def unlink(self) -> None:
        """Remove the ipc socket files this channel bound (and their folder once empty), not
        those a restarted front bound at the same paths since; open connections stay."""
        remove_ipc_sockets(self._addresses(), bound=self._files)
