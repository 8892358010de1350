"""Fans every worker message out to the request streams it concerns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cadence.core.handoff import HandOffs
from cadence.core.metrics import FrontMetrics
from cadence.core.stream import RequestStream
from cadence.transport.messages import (
    Heartbeat,
    RequestFailed,
    StateExport,
    StepOutput,
    StepsFailing,
    WorkerOutput,
    WorkerReady,
    boot_id,
    step_pieces,
)

_OFFSET_WINDOW = 50
"""Heartbeats per clock-offset estimate (5 s at the default interval): short enough to
follow the drift between two hosts' clocks, long enough to catch a beat that was not delayed."""


class OutputReader:
    """Routes worker output into the per-request buffers.

    `_push_step` is the only function in the front that loops over a step's outputs;
    whatever must happen per piece of output happens there, and it never blocks.
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
        self._last_batch = [0] * workers
        """Sequences in each worker's last step."""
        self._kv_cache_usage = [0.0] * workers
        """Each worker's share of KV cache held after its last step."""
        metrics.watch_batches(self.batch_size, workers)
        self._step_time = [metrics.step_time.labels(w) for w in labels]
        self._steps = [metrics.steps.labels(w) for w in labels]
        self._cache_queries = [metrics.prefix_cache_queries.labels(w) for w in labels]
        self._cache_hits = [metrics.prefix_cache_hits.labels(w) for w in labels]
        self.last_output_ns = [0] * workers
        """When each worker last sent a step (the supervisor's hang check reads it)."""
        self.last_heard_ns = [0] * workers
        """When each worker's heartbeat last arrived (0: none yet; the supervisor reads it)."""
        self.stalled_ns = [0] * workers
        """What each worker's last heartbeat said of its step loop: how long it has had work
        without finishing a step (the supervisor's hang check reads it)."""
        self.on_sick: Callable[[StepsFailing], None] = lambda message: None
        """Told when a worker reports its steps failing in a row (the supervisor ejects it)."""
        self.handoffs: HandOffs | None = None
        """Disaggregated serving: told of each state a prefill worker hands over, and of
        the handed-over sequences a decode worker took into its batch."""
        self._boot_id = boot_id()
        self.clock_offset_ns = [0] * workers
        """Added to a worker's timestamps to put them on the front's clock: 0 on this host;
        for a worker on another host, the least (arrival - sending) time over the last
        window of heartbeats, i.e. the clocks' offset plus the fastest one-way trip."""
        self._direct: dict[RequestStream, None] = {}
        """Streams whose adapter writes from the reader (`RequestStream.deliver`) that got
        output or their end since the last `_flush`, in arrival order."""
        self._flush_soon = False
        self._foreign = [False] * workers
        self._offset_best = [0] * workers
        self._offset_beats = [0] * workers

    def handle(self, message: WorkerOutput, recv_ns: int) -> None:
        """Dispatch one message that the front read at `recv_ns`."""
        if type(message) is StepOutput:
            self._push_step(message, recv_ns)
        elif type(message) is RequestFailed:
            stream = self._streams.get(message.seq_id)
            if stream is not None:
                stream.fail(message.failure, message.message)
        elif type(message) is Heartbeat:
            worker = message.worker
            self.last_heard_ns[worker] = recv_ns
            self.stalled_ns[worker] = message.stalled_ns
            if self._foreign[worker]:
                self._track_clock(worker, recv_ns - message.sent_ns)
        elif type(message) is WorkerReady:
            worker = message.worker
            self._foreign[worker] = bool(message.boot_id) and message.boot_id != self._boot_id
            self.clock_offset_ns[worker] = 0
            self._offset_beats[worker] = 0
            self._on_ready(message)
        elif type(message) is StepsFailing:
            self.on_sick(message)
        elif type(message) is StateExport and self.handoffs is not None:
            self.handoffs.arrived(message, recv_ns)

    def _push_step(self, message: StepOutput, recv_ns: int) -> None:
        """Push each sequence's piece of one step into its stream, then end the finished.

        The only loop over a step's outputs in the front; the pieces are read by
        `step_pieces`. A stream that is gone (cancelled after the step started) drops its
        piece. A stream whose adapter writes without awaiting is flushed to it soon after
        (`_flush`).
        """
        get = self._streams.get
        worker = message.worker
        offset = self.clock_offset_ns[worker]
        start, end = message.start_ns + offset, message.end_ns + offset
        if message.prompt_lens:  # prompts the worker tokenized; before their first token
            for seq_id, count in message.prompt_lens.items():
                stream = get(seq_id)
                if stream is not None:
                    stream.set_prompt_tokens(count)
        if message.cached_tokens:  # --prefix-caching: each new sequence's cache hit
            self._count_cached(message.cached_tokens, worker)
        if message.imported and self.handoffs is not None:  # disaggregated: hand-offs done
            self.handoffs.admitted(worker, message.imported)
        if message.piece_outputs:  # a model's text pieces: each is one position
            for seq_id in message.seq_ids:
                stream = get(seq_id)
                if stream is not None:
                    stream.counts_pieces = True
        direct = self._direct
        cpu_wait = message.cpu_wait_ns
        for seq_id, tokens, text in step_pieces(message):
            stream = get(seq_id)
            if stream is not None:
                stream.push(tokens, text, start, end, recv_ns, cpu_wait)
                if stream.deliver is not None:
                    direct[stream] = None
        for seq_id, reason in zip(message.finished_ids, message.finish_reasons):
            stream = get(seq_id)
            if stream is not None:
                stream.end(reason)
                if stream.deliver is not None:
                    direct[stream] = None
        if direct and not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)
        self.last_output_ns[worker] = recv_ns
        self._last_batch[worker] = len(message.seq_ids)
        self._kv_cache_usage[worker] = message.kv_cache_usage
        self._step_time[worker].set((end - start) / 1e9)
        self._steps[worker].inc()

    def _busy(self, worker: int) -> bool:
        return any(s.worker == worker for s in self._streams.values())

    def batch_size(self, worker: int) -> int:
        """Sequences in the worker's last step, or 0 once it has no open request: an idle
        worker sends no steps, and its last one's size would stay."""
        return self._last_batch[worker] if self._busy(worker) else 0

    def kv_cache_usage(self) -> float:
        """The workers' mean share of KV cache held after their last steps (0 for an idle
        one, whose cancelled sequences' blocks were freed without a step to say so)."""
        usage = self._kv_cache_usage
        return sum(usage[w] for w in range(len(usage)) if self._busy(w)) / len(usage)

    def _count_cached(self, cached: dict[int, int], worker: int) -> None:
        """Prompt tokens looked up in a worker's prefix cache, and those it held."""
        get = self._streams.get
        queries = hits = 0
        for seq_id, count in cached.items():
            stream = get(seq_id)
            if stream is not None:
                stream.cached_tokens = count
                queries += stream.prompt_tokens
                hits += count
        self._cache_queries[worker].inc(queries)
        self._cache_hits[worker].inc(hits)

    def _flush(self) -> None:
        """Hand each direct stream what came for it since the last flush, as one piece.

        Called soon after the messages read at one wake-up of the reader are all pushed: a
        stream's last tokens and its finish go out together, and a front that falls behind
        merges the steps that waited (as a task that wakes late does) instead of writing
        each one, and leaves room between wake-ups for its timers and tasks.
        """
        self._flush_soon = False
        direct, self._direct = self._direct, {}
        for stream in direct:
            stream.flush()

    def _track_clock(self, worker: int, sample_ns: int) -> None:
        """One heartbeat's (arrival - sending) time of a worker on another host."""
        beats = self._offset_beats[worker]
        if beats == 0 or sample_ns < self._offset_best[worker]:
            self._offset_best[worker] = sample_ns
        if beats == 0 and self.clock_offset_ns[worker] == 0:
            self.clock_offset_ns[worker] = sample_ns  # the first estimate, at once
        beats += 1
        if beats == _OFFSET_WINDOW:
            self.clock_offset_ns[worker] = self._offset_best[worker]
            beats = 0
        self._offset_beats[worker] = beats
