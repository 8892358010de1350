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
    """Engine kind: `synthetic`, `app` (a user's generator function) or `torch` (a Llama model)."""
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
    app: str = ""
    """App engine: the user's generator function as `module:function` or `path.py:function`."""
    engine_threads: int = 1
    """App engine, sync functions: threads of the worker's executor that run the function
    (default one per device; each worker owns one device)."""
    model: str = ""
    """Torch: a local Hugging Face folder (config.json + *.safetensors) or `tiny`."""
    dtype: str = "auto"
    """Torch: `float32`, `bfloat16`, `float16`, or `auto` (float32 on CPU, the checkpoint's on CUDA)."""
    kv_cache_tokens: int = 16384
    """Torch: KV cache capacity per worker, in tokens of all sequences together."""
    cuda_graph_batch: int = 32
    """Torch on CUDA: decode steps of up to this many sequences replay CUDA graphs (0: off)."""
    threads: int = 0
    """Torch on CPU: intra-op threads per rank; 0 leaves torch's default."""


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker process needs to start, wherever it runs."""

    index: int
    device: str
    """`cpu` or `cuda:N`. A tensor-parallel group's spec lists one device per rank, comma
    separated (`cuda:0,cuda:1`); the launcher starts one process per rank."""
    input_address: str
    """ZeroMQ address the worker connects to for `WorkerInputs` (front binds)."""
    output_address: str
    """ZeroMQ address the worker connects to for its outputs (front binds)."""
    engine: EngineConfig
    rank: int = 0
    """Rank in the tensor-parallel group; only rank 0 connects to the front."""
    group_size: int = 1
    """Ranks in the tensor-parallel group (1: no tensor parallelism)."""
    dist_init: str = ""
    """torch.distributed init method shared by the group's ranks (set by the launcher)."""
    extra_input_addresses: list[str] = []
    """`--fronts N`: the input sockets of fronts 1..N-1 for this worker (front 0's is
    `input_address`); the worker's one PULL connects to all and fair-queues them."""
    front_output_addresses: list[str] = []
    """`--fronts N`: the output sockets of fronts 1..N-1 (front 0's is `output_address`).
    Empty: one front. A sequence belongs to front `seq_id % N`; each step's output is split
    into one message per front that has sequences in it."""
    heartbeat_address: str = ""
    """The front's heartbeat (PUB) socket. Empty: no heartbeat (a worker inside the front)."""
    heartbeat_interval_s: float = 0.1
    """How often the worker tells the front it is alive."""
    heartbeat_timeout_s: float = 1.0
    """The worker exits when it has heard nothing from the front for this long."""
    curve_server_key: str = ""
    """tcp transport: the front's CURVE public key (Z85). Only the server's own processes are
    given it, so nothing else can complete a handshake with the front's sockets; traffic is
    encrypted. Empty: plain sockets (ipc, private to this host's user)."""
    curve_public_key: str = ""
    """The worker's own CURVE key pair (Z85), made by the front."""
    curve_secret_key: str = ""
    dist_ifname: str = ""
    """Network interface for torch.distributed between hosts (GLOO_SOCKET_IFNAME,
    NCCL_SOCKET_IFNAME). Empty: the launcher's choice (Ray: the interface of the node's IP)."""


class AddRequest(msgspec.Struct, frozen=True, array_like=True):
    seq_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: list[int] = []
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    timeout_ms: float = 0.0
    """Time left until the request's deadline when the front sent it; 0: no deadline.
    Relative, so it stays right when a worker's clock is not the front's."""
    prompt_text: str = ""
    """A text prompt for the worker to tokenize with the model's tokenizer (torch engine);
    then `prompt_token_ids` is empty."""


class WorkerInputs(msgspec.Struct, frozen=True, array_like=True, tag="in"):
    """New requests and aborts since the last message; applied at the next step boundary."""

    adds: list[AddRequest]
    aborts: list[int]
    pauses: list[int] = []
    """Sequences to skip at each step until resumed (the block overflow policy)."""
    resumes: list[int] = []
    gone_fronts: list[int] = []
    """`--fronts N`: fronts that died (sent by front 0): drop their sequences, send them nothing."""


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
    token_counts: list[int] = []
    """App workers only: when not empty, `seq_ids[i]` produced the next `token_counts[i]`
    entries of `token_ids` (one piece of several tokens). Empty: one token each."""
    texts: list[str] = []
    """Engines with their own tokenizer: `texts[i]` is the text piece of `token_ids[i]`
    (possibly empty while a character is incomplete). Empty: the front decodes bytes."""
    prompt_lens: dict[int, int] = {}
    """Prompt tokens of each sequence that the worker tokenized and prefilled in this step."""


class RequestFailed(msgspec.Struct, frozen=True, array_like=True, tag="failed"):
    """The worker rejected or lost one sequence; `message` says what to fix."""

    seq_id: int
    code: str
    """A grpc.StatusCode name, e.g. INVALID_ARGUMENT."""
    message: str


class Heartbeat(msgspec.Struct, frozen=True, array_like=True, tag="beat"):
    """Sent both ways every `heartbeat_interval_s`: the front notices a worker that is gone
    (or cut off) without waiting for its process to exit, and a worker that lost its front
    exits (a worker on another host gets no PDEATHSIG)."""

    worker: int = -1
    """The sender (-1: the front)."""
    sent_ns: int = 0
    """The sender's time.monotonic_ns() when it sent this beat."""


WorkerInput = WorkerInputs | Shutdown
WorkerOutput = WorkerReady | StepOutput | RequestFailed | Heartbeat
