"""Every message that crosses a process boundary, in one module (the request a `WorkerInputs`
carries, `AddRequest`, is cadence.vocabulary's: the engines read it too).

Messages are frozen msgspec Structs encoded once with msgpack. (What a worker is started with,
`WorkerSpec` and its `EngineConfig`, is launch configuration: cadence.config.) The front sends a worker
`WorkerInputs` (all the adds and aborts of one event-loop tick, batched) or `Shutdown`;
a worker sends the front `WorkerReady` once, then one `StepOutput` per engine step
(every sequence's new token of that step), `RequestFailed` for a request it rejects, and
`StepsFailing` once its engine fails step after step.
Sequences are named by a front-assigned integer `seq_id`, never by the client's string id,
to keep the per-step message small. Timestamps are `time.monotonic_ns()`. How a sequence
ends (`Finish`, `Failure`) is cadence's vocabulary (cadence.vocabulary), carried here.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate, repeat

import msgspec

from cadence.vocabulary import AddRequest, Failure


class WorkerInputs(msgspec.Struct, frozen=True, array_like=True, tag="in"):
    """New requests and aborts since the last message; applied at the next step boundary."""

    adds: list[AddRequest]
    aborts: list[int]
    pauses: list[int] = []
    """Sequences to skip at each step until resumed (the block overflow policy)."""
    resumes: list[int] = []
    gone_fronts: list[int] = []
    """`--fronts N`: fronts that died (sent by front 0): drop their sequences, send them nothing."""
    back_fronts: list[int] = []
    """`--fronts N`: fronts front 0 restarted since they were gone: send to them again, first
    this worker's `WorkerReady`."""
    imports: list[StateImport] = []
    """Disaggregated serving, to a decode worker: sequences another worker prefilled, each
    with its state, to decode from where they are (taken in as the batch has room)."""


class StateImport(msgspec.Struct, frozen=True, array_like=True):
    """A sequence a prefill worker started, for a decode worker to go on with: the request as
    the front first sent it, the outputs given so far and the engine's state
    (`export_state`'s bytes, opaque to everything but the engine)."""

    request: AddRequest
    generated: int
    """Outputs given so far (the first token: 1)."""
    tokens: list[int]
    """Those outputs' token ids (for the decode worker's detokenizer)."""
    state: bytes


class StateExport(msgspec.Struct, frozen=True, array_like=True, tag="handoff"):
    """A prefill worker gave a sequence its first token (in the `StepOutput` sent before
    this) and no longer holds it: its state, for the front to send to a decode worker."""

    worker: int
    seq_id: int
    generated: int
    tokens: list[int]
    state: bytes
    exported_ns: int
    """When the state was ready (the worker's clock): the hand-off's start."""


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag="shutdown"):
    """Stop stepping, drop every sequence and exit."""


class WorkerReady(msgspec.Struct, frozen=True, array_like=True, tag="ready"):
    worker: int
    pid: int
    engine: str
    load_ms: float = 0.0
    """Building the engine: reading or creating the weights, allocating the cache."""
    warmup_ms: float = 0.0
    """Warm-up steps run before reporting ready (the server turns SERVING after them)."""
    first_step_ms: float = 0.0
    """The engine's very first step, during warm-up (cold: allocations, kernel selection)."""
    warm_step_ms: float = 0.0
    """A decode step at the end of warm-up, for comparison with first_step_ms."""
    boot_id: str = ""
    """The worker's kernel boot id: the same as the front's when both read one monotonic
    clock (one host, namespaces included); otherwise the front maps the worker's
    timestamps onto its own clock (see OutputReader)."""


def boot_id() -> str:
    """This kernel's boot id (empty where there is none): processes that share it share
    time.monotonic_ns()."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class StepOutput(msgspec.Struct, frozen=True, array_like=True, tag="step"):
    """One step's output, of every engine, in one layout: the new tokens of every sequence
    that produced some.

    `seq_ids[i]` produced the next `token_counts[i]` entries of `token_ids` (one piece), whose
    text is `texts[i]`. The fast path, what a batching engine sends: `token_counts` empty, one
    token per sequence. `texts` empty: the front decodes the tokens (bytes) itself. A sequence
    in `finished_ids` produced its last token in this step; `finish_reasons` holds its Finish.
    """

    worker: int
    step: int
    start_ns: int
    end_ns: int
    seq_ids: list[int]
    token_ids: list[int]
    finished_ids: list[int]
    finish_reasons: list[int]
    token_counts: list[int] = []
    """Tokens of each sequence's piece; empty: one each."""
    texts: list[str] = []
    """Engines with their own tokenizer: the text of each sequence's piece (possibly empty
    while a character is incomplete). Empty: the front decodes bytes."""
    prompt_lens: dict[int, int] = {}
    """Prompt tokens of each sequence that the worker tokenized and prefilled in this step."""
    kv_cache_usage: float = 0.0
    """The share of the engine's KV cache held after this step, 0 to 1 (0: it has none)."""
    cached_tokens: dict[int, int] = {}
    """Prompt tokens of the prefix cache's, of each sequence whose first token is in this
    step and that had a cache hit (absent: none)."""
    piece_outputs: bool = False
    """Each piece is one output (one position of its stream, one toward max_tokens) whatever
    its token count: a batched model's text pieces. False: each token is one (an app's
    pieces), which is the same where every piece is one token."""
    imported: list[int] = []
    """Disaggregated serving: sequences this decode worker took into its batch in this step
    from `WorkerInputs.imports` (their hand-off is over)."""
    cpu_wait_ns: int = -1
    """How long the engine's threads waited for a CPU (runnable, in a run queue) from the
    worker's previous step's end to this one's: the longest wait of any one of them
    (cadence.worker.cpu_wait). -1: not measured (no /proc, or an engine not stepped by the
    batching loop)."""


def step_pieces(step: StepOutput) -> Iterator[tuple[int, int | list[int], str | None]]:
    """Each sequence's piece of `step`, in order: (seq_id, its tokens, its text or None).

    The one reading of the packing (`token_counts`, `texts`) for every consumer. A piece is
    a bare token (int) in the one-token layout and a list in the other, never a mix within
    one step; texts are all None or all str. Made of C iterators
    only: no Python frame per piece, and no object built per piece of one token, so a
    consumer's loop costs what a zip over the columns costs.
    """
    texts = step.texts or repeat(None)
    counts = step.token_counts
    if not counts:
        return zip(step.seq_ids, step.token_ids, texts)
    tokens = step.token_ids
    pieces = [tokens[at - count : at] for at, count in zip(accumulate(counts), counts)]
    return zip(step.seq_ids, pieces, texts)


class RequestFailed(msgspec.Struct, frozen=True, array_like=True, tag="failed"):
    """The worker rejected or lost one sequence; `message` says what to fix."""

    seq_id: int
    failure: Failure
    message: str


class Heartbeat(msgspec.Struct, frozen=True, array_like=True, tag="beat"):
    """Sent both ways every `heartbeat_interval_s`: the front notices a worker that is gone
    (or cut off) without waiting for its process to exit, and a worker that lost its front
    exits (a worker on another host gets no PDEATHSIG)."""

    worker: int = -1
    """The sender (-1: the front)."""
    sent_ns: int = 0
    """The sender's time.monotonic_ns() when it sent this beat."""
    stalled_ns: int = 0
    """A worker's: how long it has had sequences to step without finishing a step (0: it
    has none, or has just stepped). Front 0 judges a hang (--worker-timeout) by it, whichever
    front the sequences came from."""


class StepsFailing(msgspec.Struct, frozen=True, array_like=True, tag="sick"):
    """Sent to every front once a worker's last `steps` engine steps all failed, none
    succeeding between (--worker-max-failed-steps): each front stops routing to it, and
    front 0 restarts it."""

    worker: int
    steps: int
    message: str
    """The last failure, as its sequences were told."""


WorkerInput = WorkerInputs | Shutdown
WorkerOutput = WorkerReady | StepOutput | RequestFailed | Heartbeat | StepsFailing | StateExport
