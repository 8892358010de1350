"""Fans every worker message out to the request streams it concerns."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from cadence.api.metrics import FrontMetrics
from cadence.api.request_stream import RequestStream
from cadence.transport.messages import (
    Heartbeat,
    RequestFailed,
    StepOutput,
    WorkerOutput,
    WorkerReady,
)


class OutputReader:
    """Routes worker output into the per-request buffers.

    `handle` is the only function in the front that loops over a step's tokens (it hands
    app workers' several-token pieces to `_push_pieces`, and tokens that come with their text
    to `_push_texts`, its twins); whatever must happen per token happens there, and it never
    blocks.
    """

    def __init__(
        self,
        streams: dict[int, RequestStream],
        on_ready: Callable[[WorkerReady], None],
        metrics: FrontMetrics,
        workers: int,
    ) -> None:
        self._streams = streams
        self._on_ready = on_ready
        labels = [str(i) for i in range(workers)]
        self._batch_size = [metrics.batch_size.labels(w) for w in labels]
        self._step_time = [metrics.step_time.labels(w) for w in labels]
        self._steps = [metrics.steps.labels(w) for w in labels]
        self.last_output_ns = [0] * workers
        """When each worker last sent a step (the supervisor's hang check reads it)."""
        self.last_heard_ns = [0] * workers
        """When each worker's heartbeat last arrived (0: none yet; the supervisor reads it)."""

    def handle(self, message: WorkerOutput, recv_ns: int) -> None:
        """Dispatch one message that the front read at `recv_ns`."""
        if type(message) is StepOutput:
            streams = self._streams
            start, end = message.start_ns, message.end_ns
            if message.prompt_lens:  # prompts the worker tokenized; before their first token
                for seq_id, count in message.prompt_lens.items():
                    stream = streams.get(seq_id)
                    if stream is not None:
                        stream.set_prompt_tokens(count)
            if message.token_counts:
                self._push_pieces(message, recv_ns)
            elif message.texts:
                self._push_texts(message, recv_ns)
            else:
                for seq_id, token in zip(message.seq_ids, message.token_ids):
                    stream = streams.get(seq_id)
                    # A missing stream was cancelled after the step started; its token is dropped.
                    if stream is not None:
                        stream.push(token, start, end, recv_ns)
            for seq_id, reason in zip(message.finished_ids, message.finish_reasons):
                stream = streams.get(seq_id)
                if stream is not None:
                    stream.end(reason)
            worker = message.worker
            self.last_output_ns[worker] = recv_ns
            self._batch_size[worker].set(len(message.seq_ids))
            self._step_time[worker].set((end - start) / 1e9)
            self._steps[worker].inc()
        elif type(message) is RequestFailed:
            stream = self._streams.get(message.seq_id)
            if stream is not None:
                stream.fail(grpc.StatusCode[message.code], message.message)
        elif type(message) is Heartbeat:
            self.last_heard_ns[message.worker] = recv_ns
        elif type(message) is WorkerReady:
            self._on_ready(message)

    def _push_pieces(self, message: StepOutput, recv_ns: int) -> None:
        """An app worker's message: `seq_ids[i]` produced `token_counts[i]` tokens (one piece)."""
        streams = self._streams
        start, end = message.start_ns, message.end_ns
        tokens = message.token_ids
        at = 0
        for seq_id, count in zip(message.seq_ids, message.token_counts):
            stream = streams.get(seq_id)
            if stream is not None:
                if count == 1:
                    stream.push(tokens[at], start, end, recv_ns)
                else:
                    stream.push_piece(tokens[at:at + count], start, end, recv_ns)
            at += count

    def _push_texts(self, message: StepOutput, recv_ns: int) -> None:
        """A worker that detokenizes (torch engine): each token comes with its text piece."""
        streams = self._streams
        start, end = message.start_ns, message.end_ns
        for seq_id, token, text in zip(message.seq_ids, message.token_ids, message.texts):
            stream = streams.get(seq_id)
            if stream is not None:
                stream.push_text(token, text, start, end, recv_ns)
