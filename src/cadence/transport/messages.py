"""Every message that crosses a process boundary, in one module.

Messages are frozen msgspec Structs encoded once with msgpack. The front sends a worker
`WorkerInputs` (all the adds and aborts of one event-loop tick, batched) or `Shutdown`;
a worker sends the front `WorkerReady` once, then one `StepOutput` per engine step
(every sequence's new token of that step), and `RequestFailed` for a request it rejects.
Sequences are named by a front-assigned integer `seq_id`, never by the client's string id,
to keep the per-step message small. Timestamps are `time.monotonic_ns()`.
"""

from __future__ import annotations

import enum

import msgspec


class Finish(enum.IntEnum):
    """Why a sequence ended; the values are those of the proto's FinishReason."""

    NONE = 0
    LENGTH = 1
    STOP = 2
    CANCELLED = 3


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker needs to build its engine. Sent once, as JSON, at start-up."""

    name: str = "synthetic"
    """Engine kind: `synthetic`."""
    step_ms: float = 20.0
    """Synthetic: base duration of one decode step."""
    per_seq_ms: float = 0.0
    """Synthetic: added to a step for each sequence in the batch."""
    prefill_ms_per_token: float = 0.01
    """Synthetic: added to a step for each prompt token of the sequences it admits."""
    jitter_ms: float = 0.0
    """Synthetic: standard deviation of Gaussian noise on each step (clipped at 0)."""
    first_step_ms: float = 0.0
    """Synthetic: extra time on the worker's first step (cold start)."""
    seed: int = 0
    """Makes token ids and jitter reproducible."""
    max_batch: int = 512
    """Sequences stepped together at most; more wait in the worker's queue."""


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker process needs to start, wherever it runs."""

    index: int
    device: str
    """`cpu` or `cuda:N`."""
    input_address: str
    """ZeroMQ address the worker connects to for `WorkerInputs` (front binds)."""
    output_address: str
    """ZeroMQ address the worker connects to for its outputs (front binds)."""
    engine: EngineConfig


class AddRequest(msgspec.Struct, frozen=True, array_like=True):
    seq_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: list[int] = []
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int = 0


class WorkerInputs(msgspec.Struct, frozen=True, array_like=True, tag="in"):
    """New requests and aborts since the last message; applied at the next step boundary."""

    adds: list[AddRequest]
    aborts: list[int]


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag="shutdown"):
    """Stop stepping, drop every sequence and exit."""


class WorkerReady(msgspec.Struct, frozen=True, array_like=True, tag="ready"):
    worker: int
    pid: int
    engine: str


class StepOutput(msgspec.Struct, frozen=True, array_like=True, tag="step"):
    """One engine step: the new token of every sequence that was stepped.

    `seq_ids[i]` produced `token_ids[i]`. A sequence in `finished_ids` produced its last
    token in this step; `finish_reasons` holds its FinishReason value (proto enum).
    """

    worker: int
    step: int
    start_ns: int
    end_ns: int
    seq_ids: list[int]
    token_ids: list[int]
    finished_ids: list[int]
    finish_reasons: list[int]


class RequestFailed(msgspec.Struct, frozen=True, array_like=True, tag="failed"):
    """The worker rejected or lost one sequence; `message` says what to fix."""

    seq_id: int
    code: str
    """A grpc.StatusCode name, e.g. INVALID_ARGUMENT."""
    message: str


WorkerInput = WorkerInputs | Shutdown
WorkerOutput = WorkerReady | StepOutput | RequestFailed
