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
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from cadence.config import WorkerSpec
from cadence.transport.messages import (
    AddRequest,
    Heartbeat,
    RequestFailed,
    Shutdown,
    StepOutput,
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


def front_addresses(base: str, front: int, workers: int) -> tuple[list[str], str]:
    """`--fronts N` (ipc only): front `front`'s input sockets (one per worker) and output
    socket, in the folder `base` that front 0 created; every front and worker can derive them."""
    return ([f"ipc://{base}/f{front}-in-{i}" for i in range(workers)], f"ipc://{base}/f{front}-out")


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
        self._flush_scheduled = False
        self._encode = msgspec.msgpack.Encoder().encode

    def add(self, request: msgspec.Raw) -> None:
        """Send one request (`encode_add`'s result) with this tick's batch."""
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
        if self._adds or self._aborts or self._pauses or self._resumes:
            # The worker decodes `adds` as AddRequests: the raw frames are spliced in as is.
            message = WorkerInputs(self._adds, self._aborts, self._pauses, self._resumes)
            self._adds, self._aborts, self._pauses, self._resumes = [], [], [], []
            # Never blocks: the input socket has no high-water mark and admission bounds
            # how much can be outstanding. It fails only when no worker is connected,
            # i.e. the worker died; the front's monitor fails that worker's streams.
            try:
                self._socket.send(self._encode(message), zmq.NOBLOCK)
            except zmq.Again:
                pass


def _sibling(address: str, name: str) -> str:
    """Another socket's address next to `address`: the same folder (ipc) or host (tcp)."""
    if address.startswith("ipc://"):
        return f"ipc://{os.path.dirname(address[len('ipc://'):])}/{name}"
    return address.rsplit(":", 1)[0] + ":*"


class FrontChannel:
    """All of the front's sockets: one `WorkerLink` per worker, the shared output socket, and
    the heartbeat (PUB) socket.

    `secure` (what tcp uses) makes every socket a CURVE server: a peer needs the front's
    public key, which only the specs of the server's own workers carry, and all traffic is
    encrypted. ipc sockets live in a private folder instead.
    """

    def __init__(self, input_addresses: list[str], output_address: str, *,
                 secure: bool = False) -> None:
        self._context = zmq.Context()
        self.curve_server_key = ""
        self.curve_client_keys = ("", "")
        """(public, secret) Z85 key pair for this front's workers; empty unless secure."""
        if secure:
            public, secret = zmq.curve_keypair()
            self.curve_server_key = public.decode()
            self.curve_client_keys = tuple(k.decode() for k in zmq.curve_keypair())
            for option, value in ((zmq.CURVE_SERVER, 1), (zmq.CURVE_SECRETKEY, secret),
                                  (zmq.CURVE_PUBLICKEY, public)):
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
        self._heartbeat.bind(_sibling(output_address, "hb"))
        self.heartbeat_address = self._heartbeat.getsockopt_string(zmq.LAST_ENDPOINT)
        self._beat = msgspec.msgpack.encode(Heartbeat())
        self._decode = msgspec.msgpack.Decoder(WorkerOutput).decode
        self._stop_reading: Callable[[], None] | None = None

    def beat(self) -> None:
        """Tell every worker the front is alive (never blocks: PUB drops when full)."""
        self._heartbeat.send(self._beat, zmq.NOBLOCK)

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
        self._heartbeat.close(linger=0)
        self._context.term()
        remove_ipc_sockets([*self.input_addresses, self.output_address, self.heartbeat_address])


def remove_ipc_sockets(addresses: list[str]) -> None:
    """Unlink the socket files of the ipc addresses among `addresses`, then their folders
    once empty (a folder that still holds another's sockets stays)."""
    folders = set()
    for address in addresses:
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
                 output_hwm: int = OUTPUT_HWM, *, extra_inputs: list[str] = (),
                 front_outputs: list[str] = (), curve: WorkerSpec | None = None) -> None:
        # output_hwm 0 (no limit) is for a worker inside the front: blocking on its own
        # event loop's reader would deadlock.
        self._context = _worker_context(curve)
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
        self.fronts = 1 + len(front_outputs)
        self.gone: set[int] = set()
        """Fronts that died (`--fronts N`); nothing more is sent to them."""
        self.newly_gone: list[int] = []
        """Fronts reported gone since the caller last emptied this list."""
        self._back: list[int] = []
        """Fronts reported restarted, still to be sent this worker's `WorkerReady`."""
        self._ready_frame = b""
        """This worker's `WorkerReady`, for a front that is restarted later."""
        if self.fronts > 1:
            # --fronts N: the same PULL takes every front's inputs; one PUSH per front.
            for address in extra_inputs:
                self._input.connect(address)
            self._outputs = [self._output]
            for address in front_outputs:
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, output_hwm)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(address)
                self._outputs.append(sock)
            self._pending: list[WorkerInput] = []
            self.send = self._send_split
            self.receive = self._receive_multi

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

    # --- --fronts N: route each message to the front(s) that own its sequences ----------

    def _note(self, message: WorkerInput) -> WorkerInput:
        if type(message) is WorkerInputs:
            for front in message.gone_fronts:
                if front not in self.gone:
                    self.gone.add(front)
                    self.newly_gone.append(front)
            for front in message.back_fronts:
                self.gone.discard(front)
                self._back.append(front)
        return message

    def _receive_multi(self, timeout_ms: int | None) -> list[WorkerInput]:
        messages, self._pending = self._pending, []
        if messages:
            timeout_ms = 0
        if timeout_ms != 0 and not self._poller.poll(timeout_ms):
            return messages
        while True:
            try:
                messages.append(self._note(self._decode(self._input.recv(zmq.NOBLOCK))))
            except zmq.Again:
                break
        while self._back:  # a restarted front learns this worker is ready, like the others did
            front = self._back.pop()
            if self._ready_frame and front not in self.gone:
                self._send_to(front, self._ready_frame)
        return messages

    def _send_to(self, front: int, frame: bytes) -> None:
        """Send to one front, blocking while its queue is full, but never on a dead front:
        while blocked, inputs are read (kept for the next `receive`) to learn of its death."""
        sock = self._outputs[front]
        poller = None
        while front not in self.gone:
            try:
                sock.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if poller is None:
                poller = zmq.Poller()
                poller.register(sock, zmq.POLLOUT)
                poller.register(self._input, zmq.POLLIN)
            ready = dict(poller.poll(100))
            if self._input in ready:
                while True:
                    try:
                        self._pending.append(self._note(self._decode(self._input.recv(zmq.NOBLOCK))))
                    except zmq.Again:
                        break

    def _send_split(self, message: WorkerOutput) -> None:
        n, encode = self.fronts, self._encode
        kind = type(message)
        if kind is StepOutput:
            for front, part in enumerate(split_step(message, n)):
                if part is not None and front not in self.gone:
                    self._send_to(front, encode(part))
        elif kind is RequestFailed:
            self._send_to(message.seq_id % n, encode(message))
        else:  # WorkerReady: every front
            frame = self._ready_frame = encode(message)
            for front in range(n):
                self._send_to(front, frame)

    def close(self) -> None:
        self._input.close(linger=0)
        if self.fronts > 1:
            for sock in self._outputs[1:]:
                sock.close(linger=0)
        self._output.close()
        self._context.term()


def split_step(message: StepOutput, fronts: int) -> list[StepOutput | None]:
    """One step's output as one message per front (`seq_id % fronts` owns a sequence);
    None for a front with nothing in this step."""
    seq_ids = [[] for _ in range(fronts)]
    tokens = [[] for _ in range(fronts)]
    counts = [[] for _ in range(fronts)]
    texts = [[] for _ in range(fronts)]
    finished = [[] for _ in range(fronts)]
    reasons = [[] for _ in range(fronts)]
    prompt_lens: list[dict[int, int]] = [{} for _ in range(fronts)]
    if message.token_counts:
        at = 0
        for seq_id, count in zip(message.seq_ids, message.token_counts):
            f = seq_id % fronts
            seq_ids[f].append(seq_id)
            counts[f].append(count)
            tokens[f].extend(message.token_ids[at:at + count])
            at += count
    else:
        for i, (seq_id, token) in enumerate(zip(message.seq_ids, message.token_ids)):
            f = seq_id % fronts
            seq_ids[f].append(seq_id)
            tokens[f].append(token)
            if message.texts:
                texts[f].append(message.texts[i])
    for seq_id, reason in zip(message.finished_ids, message.finish_reasons):
        finished[seq_id % fronts].append(seq_id)
        reasons[seq_id % fronts].append(reason)
    for seq_id, count in message.prompt_lens.items():
        prompt_lens[seq_id % fronts][seq_id] = count
    return [
        StepOutput(message.worker, message.step, message.start_ns, message.end_ns, seq_ids[f],
                   tokens[f], finished[f], reasons[f], counts[f], texts[f], prompt_lens[f])
        if seq_ids[f] or finished[f] or prompt_lens[f] else None
        for f in range(fronts)
    ]


def _worker_context(spec: WorkerSpec | None) -> zmq.Context:
    """A ZeroMQ context whose sockets are CURVE clients of the front when `spec` says so."""
    context = zmq.Context()
    if spec is not None and spec.curve_server_key:
        for option, value in ((zmq.CURVE_SERVERKEY, spec.curve_server_key),
                              (zmq.CURVE_PUBLICKEY, spec.curve_public_key),
                              (zmq.CURVE_SECRETKEY, spec.curve_secret_key)):
            context.setsockopt(option, value.encode())
    return context


class WorkerHeartbeat(threading.Thread):
    """A worker's side of the heartbeat, on its own thread and sockets so that a long engine
    step delays nothing: every `heartbeat_interval_s` it tells the front this worker is alive,
    and when it has heard nothing from the front for `heartbeat_timeout_s` it calls `on_lost`
    (the worker exits). A tensor-parallel follower only listens (`send=False`).
    """

    def __init__(self, spec: WorkerSpec, on_lost: Callable[[], None], *, send: bool = True) -> None:
        super().__init__(name="cadence-heartbeat", daemon=True)
        self._spec = spec
        self._on_lost = on_lost
        self._send = send
        self._stop = threading.Event()

    def run(self) -> None:
        spec = self._spec
        context = _worker_context(spec)
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
        encode, worker = msgspec.msgpack.encode, spec.index
        interval, timeout = spec.heartbeat_interval_s, spec.heartbeat_timeout_s
        heard = time.monotonic()
        try:
            while not self._stop.is_set():
                if tell is not None:
                    with contextlib.suppress(zmq.Again):
                        tell.send(encode(Heartbeat(worker, time.monotonic_ns())), zmq.NOBLOCK)
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
