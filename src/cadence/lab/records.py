"""What the load generator and the trace receiver record, raw, per chunk, never aggregated:
each request (`RequestRecord`), each load process's share of a run (`ProcessResult`) and each
span a traced server sent (`ReceivedSpan`). The load generator (`cadence.lab.load`) and the
measurements (`cadence.lab.measure`) write them; the analysis, the results and the reports
read them: they sit below those stages so that none of them imports another."""

from __future__ import annotations

import msgspec

CLIENT_CANCELLED = "CLIENT_CANCELLED"
"""The code of a request the client cancelled on purpose (`--cancel-ms`): not a failure of
the server's, so not among the run's errors."""


class RequestRecord(msgspec.Struct, array_like=True, kw_only=True):
    """One request as the client saw it. Times are `time.monotonic_ns()` on the client host.

    Per-chunk lists are parallel: chunk i arrived at `arrival_ns[i]` with `tokens[i]`
    tokens at output position `index[i]`. The `t_*` lists hold the server's Timing of
    each chunk when the request asked for it (else they are empty).
    """

    request_id: str
    process: int
    start_ns: int
    """Just before the request was sent."""
    end_ns: int = 0
    """When the stream ended (last chunk or error)."""
    code: str = "OK"
    """gRPC status code name."""
    error: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    finish_reason: int = 0
    arrival_ns: list[int] = []
    tokens: list[int] = []
    index: list[int] = []
    worker: int = -1
    """The worker that served it (with timing; -1 without)."""
    t_received_ns: int = 0
    t_scheduled_ns: int = 0
    t_step_start_ns: list[int] = []
    t_step_end_ns: list[int] = []
    t_front_recv_ns: list[int] = []
    t_send_ns: list[int] = []
    loop_lag: list[str] = []
    """With timing, from cadence: the front's loop-lag tally at the stream's start and end
    (as `cadence.proto.loop_lag` encodes them); empty from other servers."""
    trace_id: str = ""
    """The W3C trace id the request was sent with (`traceparent`, 32 hex digits): a traced
    server's span for it carries the same id (`cadence bench --otlp-receive`)."""
    connect_ns: int = -1
    """HTTP: how long this request waited for a new connection to be made (TCP connect and,
    over https, the TLS handshake), a part of its TTFT; 0 when it went on a connection that
    was already open. -1: not measured (gRPC opens its channels before the run)."""
    scheduled_ns: int = 0
    """Open loop (a rate, a trace): when the schedule meant the request to go; `start_ns`
    minus it is its dispatch delay. 0 in a closed loop."""
    turn: int = 0
    """Its turn in its conversation (1 first); 0 outside one."""
    cached_tokens: int = -1
    """Prompt tokens the server says it had cached (OpenAI `usage.prompt_tokens_details.
    cached_tokens`, cadence.v1's and KServe's `cached_tokens`); -1: the server did not say."""
    population: str = ""
    """Its client population (slow_reader, cancelling, deadline, plain); "" in a run of one
    behaviour."""
    request_class: str = ""
    """Its request class (`--mix`); "" in a run of one class."""
    first_reasoning_ns: int = 0
    """OpenAI, a server that streams reasoning apart from the answer (`delta.reasoning_content`
    or `delta.reasoning`): when its first reasoning output arrived; 0: none came."""
    first_answer_ns: int = 0
    """Such a server: when its first answer output (`delta.content`) arrived; 0: none came,
    or no reasoning did."""
    usage_outputs: int = -1
    """OpenAI, a server whose events carry no position of its own: the outputs its
    `usage.completion_tokens` counts, compared with the text events that arrived (each one
    position) and never spread over them; -1: it sent no usage, or its events are numbered
    (cadence's extension)."""
    prefill_worker: int = -1
    """Disaggregated serving (cadence, with timing): the worker that prefilled the request
    before it was handed to `worker`; -1: not handed off."""
    t_handoff_ns: int = 0
    """With `prefill_worker`: when the front got the request's state from it (server)."""
    t_step_cpu_wait_ns: list[int] = []
    """cadence.v1 with timing, per chunk: how long the worker's engine threads waited for a
    CPU from its step before the one of the chunk's first output to that step's end (the
    host's part of the step's time), -1 where the chunk carried none; empty where no chunk
    did (a server that cannot measure it, or one from before it could)."""

    def note_handoff(self, worker: int, prefill_worker: int, handoff_ns: int) -> None:
        """A chunk's timing says the stream was handed from `prefill_worker` to a decode
        worker: that one is the record's worker (`worker`, unless the chunk is the prefill
        worker's own first token)."""
        self.prefill_worker = prefill_worker
        self.t_handoff_ns = handoff_ns
        if worker != prefill_worker:
            self.worker = worker

    def chunk_workers(self) -> list[int]:
        """With timing: the worker whose step made each chunk's first token, `worker`, but
        for a stream handed off, the chunks the front read before it got the state (the
        prefill worker's first token)."""
        made = self.t_step_start_ns
        if self.prefill_worker < 0:
            return [self.worker] * len(made)
        handoff, prefill = self.t_handoff_ns, self.prefill_worker
        return [
            prefill if 0 < recv < handoff else self.worker
            for recv in self.t_front_recv_ns[: len(made)]
        ]

    @property
    def output_tokens(self) -> int:
        """The outputs it delivered: its positions, or the server's own count where that says
        more (an SSE server that sends several tokens an event): tokens/s in the server's
        tokens, while positions and gaps stay per event."""
        return max(sum(self.tokens), self.usage_outputs)


class Saturation(msgspec.Struct, kw_only=True):
    """The over-saturation stop's view of a rising load (`cadence.lab.load.saturation`)."""

    window_s: float = 0.0
    stopped: bool = False
    """The run ended early: the server no longer kept up."""
    knee_rate_per_s: float | None = None
    """The offered rate at which it stopped keeping up (when it stopped)."""
    knee_at_s: float | None = None
    stopped_at_s: float | None = None
    peak_achieved_rate_per_s: float | None = None
    """The most requests/s that ended in one window."""
    windows: list[list[float]] = []
    """[start s, offered requests/s, achieved requests/s, TTFT p50 ms] of each window judged
    (rates of the whole run; TTFT NaN when too few ended, Infinity when none did)."""


class ProcessResult(msgspec.Struct, array_like=True):
    """What one load process sends back: its records and the CPU it spent on them."""

    process: int
    records: list[RequestRecord]
    cpu_s: float
    """User + system CPU of the process from the agreed start to its last record (the
    chunks' parsing after that is not in it: it competes with no arrival)."""
    wall_s: float
    schedule_slips: int
    """Open loop: arrivals the process was late for (the schedule shifted instead)."""
    started_ns: int = 0
    """When the process's run began (time.monotonic_ns): the open loop's time zero."""
    schedule_lag_ms: list[float] = []
    """Open loop: per request, its actual send time minus its intended one (the unshifted
    schedule); empty in a closed loop."""
    aborted: str | None = None
    """Why the process stopped sending early (`FailureStreak`); None: it ran to its end."""
    saturation: Saturation | None = None
    """With the over-saturation stop: what it saw of the load."""
    loop_late_ms: list[float] = []
    """How late each tick of the process's loop ran (`cadence.lab.load.loop_lateness`)."""
    loop_stalls: list[tuple[int, int]] = []
    """The stretches its loop ran late: (from, to), time.monotonic_ns."""


MAX_SPANS = 500_000
"""Spans the trace receiver keeps at most: a server that traces far more than the bench's
requests (every internal call) must not grow the bench without bound."""
MAX_KEPT_BYTES = 256 * 2**20
"""The memory the kept spans may take at most (as `trace_receiver.span_bytes` reckons it):
spans are bounded by their size as well as their number, so a few spans with megabytes of
attributes cannot do what MAX_SPANS alone would let them."""


class ReceivedSpan(msgspec.Struct, frozen=True, array_like=True):
    """One span as a server exported it (`cadence.lab.measure.trace_receiver`); times are the
    server's wall clock (Unix ns)."""

    trace_id: str
    span_id: str
    parent_id: str
    """"" for a span without a parent (then it is not ours: the bench always sends one)."""
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, str | int | float | bool]
    """Scalar attributes only (what the split reads)."""
    events: list[tuple[str, int]]
    error: str | None
    """The span's status message (or "error") when its status is ERROR."""
