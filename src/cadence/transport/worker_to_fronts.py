"""A worker's side of `--fronts N`: several front processes share the workers. A sequence
belongs to front `seq_id % N` (core.generation.sequence_ids); each front has its own sockets
(sockets.front_addresses), and a worker reads every front's inputs on one socket and sends each
step's output split by owner (`split_step`), never to a front that died."""

from __future__ import annotations

import zmq

from cadence.config import WorkerSpec
from cadence.transport.messages import (
    RequestFailed,
    StepOutput,
    WorkerInput,
    WorkerInputs,
    WorkerOutput,
    WorkerReady,
    step_pieces,
)
from cadence.transport.sockets import OUTPUT_HWM
from cadence.transport.worker_channel import WorkerChannel


def worker_channel(spec: WorkerSpec, output_hwm: int = OUTPUT_HWM) -> WorkerChannel:
    """The worker's end for `spec`: to its one front, or to every front with `--fronts N`."""
    if spec.front_output_addresses:
        return MultiFrontChannel(
            spec.input_address,
            spec.output_address,
            output_hwm,
            extra_inputs=spec.extra_input_addresses,
            front_outputs=spec.front_output_addresses,
            curve=spec,
        )
    return WorkerChannel(spec.input_address, spec.output_address, output_hwm, curve=spec)


class MultiFrontChannel(WorkerChannel):
    """A worker's end with `--fronts N`: the same PULL takes every front's inputs; one PUSH
    per front, each sent only what its front owns."""

    def __init__(
        self,
        input_address: str,
        output_address: str,
        output_hwm: int = OUTPUT_HWM,
        *,
        extra_inputs: list[str],
        front_outputs: list[str],
        curve: WorkerSpec | None = None,
    ) -> None:
        super().__init__(input_address, output_address, output_hwm, curve=curve)
        self.fronts = 1 + len(front_outputs)
        self.gone: set[int] = set()
        """Fronts that died; nothing more is sent to them."""
        self._back: list[int] = []
        """Fronts reported restarted, still to be sent this worker's `WorkerReady`."""
        self._ready_frame = b""
        """This worker's `WorkerReady`, for a front that is restarted later."""
        for address in extra_inputs:
            self._input.connect(address)
        self._outputs = [self._output, *map(self._connect_output, front_outputs)]
        self._pending: list[WorkerInput] = []

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

    def receive(self, timeout_ms: int | None) -> list[WorkerInput]:
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
                        self._pending.append(
                            self._note(self._decode(self._input.recv(zmq.NOBLOCK)))
                        )
                    except zmq.Again:
                        break

    def send(self, message: WorkerOutput) -> None:
        n, encode = self.fronts, self._encode
        if type(message) is StepOutput:
            for front, part in enumerate(split_step(message, n)):
                if part is not None and front not in self.gone:
                    self._send_to(front, encode(part))
        elif type(message) is RequestFailed:
            self._send_to(message.seq_id % n, encode(message))
        else:  # WorkerReady, StepsFailing: every front
            frame = encode(message)
            if type(message) is WorkerReady:
                self._ready_frame = frame
            for front in range(n):
                self._send_to(front, frame)

    def close(self) -> None:
        for sock in self._outputs[1:]:
            sock.close(linger=0)
        super().close()


def split_step(message: StepOutput, fronts: int) -> list[StepOutput | None]:
    """One step's output as one message per front (`seq_id % fronts` owns a sequence);
    None for a front with nothing in this step."""
    seq_ids: list[list[int]] = [[] for _ in range(fronts)]
    tokens: list[list[int]] = [[] for _ in range(fronts)]
    counts: list[list[int]] = [[] for _ in range(fronts)]
    texts: list[list[str]] = [[] for _ in range(fronts)]
    finished: list[list[int]] = [[] for _ in range(fronts)]
    reasons: list[list[int]] = [[] for _ in range(fronts)]
    prompt_lens: list[dict[int, int]] = [{} for _ in range(fronts)]
    cached: list[dict[int, int]] = [{} for _ in range(fronts)]
    # A step's pieces are all bare tokens or all lists, and its texts all None or all str
    # (step_pieces), so each part comes out in its step's layout.
    for seq_id, piece, text in step_pieces(message):
        f = seq_id % fronts
        seq_ids[f].append(seq_id)
        if isinstance(piece, int):
            tokens[f].append(piece)
        else:
            tokens[f] += piece
            counts[f].append(len(piece))
        if text is not None:
            texts[f].append(text)
    for seq_id, reason in zip(message.finished_ids, message.finish_reasons):
        finished[seq_id % fronts].append(seq_id)
        reasons[seq_id % fronts].append(reason)
    for seq_id, count in message.prompt_lens.items():
        prompt_lens[seq_id % fronts][seq_id] = count
    for seq_id, count in message.cached_tokens.items():
        cached[seq_id % fronts][seq_id] = count
    imported: list[list[int]] = [[] for _ in range(fronts)]
    for seq_id in message.imported:
        imported[seq_id % fronts].append(seq_id)
    return [
        StepOutput(
            message.worker,
            message.step,
            message.start_ns,
            message.end_ns,
            seq_ids[f],
            tokens[f],
            finished[f],
            reasons[f],
            counts[f],
            texts[f],
            prompt_lens[f],
            message.kv_cache_usage,
            cached[f],
            piece_outputs=message.piece_outputs,
            imported=imported[f],
            cpu_wait_ns=message.cpu_wait_ns,
        )
        if seq_ids[f] or finished[f] or prompt_lens[f] or imported[f]
        else None
        for f in range(fronts)
    ]
