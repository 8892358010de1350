"""Configuration: the server's (`ServerConfig`), built once from the command line or by a
program, and what each worker is launched with (`WorkerSpec`, `EngineConfig`).

The defaults live here only; the CLI reads its defaults from these classes."""

from __future__ import annotations

import msgspec


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker needs to build its engine. Sent once, as JSON, at start-up."""

    name: str = "synthetic"
    """Engine kind: `synthetic`, `app` (a user's generator function), `torch` (a Llama model),
    `model` (a user's batched model class, `model_class`) or `transformers` (any causal LM
    that transformers loads from `model`, served as a model class)."""
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
    step_ms_by_worker: tuple[float, ...] = ()
    """Synthetic: each worker's decode step instead of step_ms, one value per worker in
    device order (cards of different speeds); empty: step_ms for all."""
    seed: int = 0
    """Makes token ids and jitter reproducible."""
    max_batch: int = 512
    """Sequences stepped together at most; more wait in the worker's queue."""
    app: str = ""
    """App engine: the user's generator function as `module:function` or `path.py:function`."""
    model_class: str = ""
    """Model engine: the user's batched model class as `module:Class` or `path.py:Class`
    (cadence.engines.user_model; docs/models.md)."""
    batch_timeout_ms: float = 10.0
    """Model engine, a class with generate_stream(batch): how long the first waiting request
    waits for others to join its batch (fewer than max_batch) before the batch starts."""
    engine_threads: int = 1
    """App engine, sync functions: threads of the worker's executor that run the function
    (default one per device; each worker owns one device)."""
    model: str = ""
    """Torch: a local Hugging Face folder (config.json + *.safetensors) or `tiny`. Transformers
    and model classes: the folder the model loads (given to a class as `model=`)."""
    dtype: str = "auto"
    """Torch and transformers: `float32`, `bfloat16`, `float16`, or `auto` (float32 on CPU,
    the checkpoint's on CUDA)."""
    kv_cache_tokens: int = 16384
    """Torch: KV cache capacity per worker, in tokens of all sequences together."""
    cuda_graph_batch: int = 32
    """Torch on CUDA: decode steps of up to this many sequences replay CUDA graphs (0: off)."""
    threads: int = 0
    """Torch and transformers on CPU: intra-op threads per rank; 0 leaves torch's default."""
    max_step_tokens: int = 0
    """A step's token budget: decoded sequences + prompt tokens prefilled; an engine that
    takes prefill chunks prefills a long prompt over several steps within it (0: no budget,
    every admitted prompt whole in one step). See cadence.worker.step_budget."""
    itl_target_ms: float = 0.0
    """A step's budget from the worker's measured step-time model, so a step takes about
    this long while prefill progresses (0: none). Exclusive with max_step_tokens."""

    @property
    def tokenizes_text(self) -> bool:
        """Text prompts go to the worker, which tokenizes them with the model's tokenizer."""
        return self.name in ("torch", "model", "transformers")


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


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 50051
    """0 asks the OS for a free port."""
    devices: list[str] = msgspec.field(default_factory=lambda: ["cpu"])
    """One worker per entry: `cpu` or `cuda:N`; a tensor-parallel worker lists one device per
    rank, comma separated (see `group_devices`)."""
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    max_concurrent: int = 1024
    """Streams admitted at once; more are refused with RESOURCE_EXHAUSTED."""
    queue_capacity: int = 64
    """Steps of output that may wait in a request's buffer before the overflow policy applies."""
    overflow: str = "merge"
    """`merge`, `block` or `abort`; see cadence.api.request_stream."""
    stall_timeout_s: float | None = None
    """Cut off a stream whose client reads nothing for this long (None: never)."""
    max_message_bytes: int = 4 * 1024 * 1024
    """Largest request message the server accepts."""
    accept_ahead: int = 64
    """Incoming calls of each streaming method requested from gRPC's core before they arrive
    (0: grpc.aio's own one at a time). See cadence.net.call_acceptor."""
    max_tokens_limit: int = 16384
    """Largest max_tokens a request may ask for."""
    max_prompt_tokens: int = 65536
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free port); None: no metrics endpoint."""
    transport: str = "ipc"
    """`ipc` (one host) or `tcp` (CURVE-encrypted; what `launcher="ray"` needs)."""
    worker_host: str = ""
    """tcp: the address the front binds for its workers' sockets. Empty: the Ray node's IP
    with the Ray launcher, else 127.0.0.1."""
    launcher: str = "local"
    """`local` (child processes) or `ray` (actors in a Ray cluster; see docs/ray.md)."""
    ray_address: str = ""
    """Ray cluster to join (`HOST:PORT` or `auto`); empty: start a Ray instance on this host."""
    dist_ifname: str = ""
    """torch.distributed's network interface between hosts (GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME); empty: the interface that carries the Ray node's IP."""
    heartbeat_interval_s: float = 0.1
    """Front and workers tell each other they are alive this often."""
    heartbeat_timeout_s: float = 1.0
    """A worker silent this long is stopped and restarted; a worker that hears nothing from
    the front this long exits."""
    startup_timeout_s: float = 60.0
    worker_timeout_s: float | None = 60.0
    """A worker with open requests that sends no step for this long is killed and restarted
    (None: never)."""
    restart_workers: bool = True
    """Restart a worker that died, with back-off; its streams fail with UNAVAILABLE."""
    drain_timeout_s: float = 5.0
    """On shutdown, open streams get this long to finish before they are cancelled."""
    app_in_front: bool = False
    """App engine: run the function in the front process instead of one worker process per
    device (shared in-process state; shares the front's GIL). See docs/apps.md."""
    tls_cert: str | None = None
    """PEM certificate chain the gRPC port presents; with `tls_key`, the port speaks TLS only."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""
    tls_client_ca: str | None = None
    """PEM CA certificates; clients must present a certificate one of them signed (mutual TLS)."""
    auth_token_file: str | None = None
    """Accepted bearer tokens, one per line; every RPC but health must send one. See
    cadence.api.security."""
    grpc_server: str = "aio"
    """`aio` (grpc.aio) or `native`: gRPC served by Envoy's HTTP/2 through pyvoy, the front
    running in Envoy's process (cadence.lifecycle.envoy_front), one Envoy per front."""
    fronts: int = 1
    """Front processes serving the port (SO_REUSEPORT), each connected to every worker; the
    first also launches the workers and the other fronts. See docs/architecture.md#fronts."""
    kserve_model_name: str = "cadence"
    """The model's name in the Open Inference Protocol (`inference.GRPCInferenceService`,
    served on the same port); see docs/kserve.md."""
    served_model_name: str = ""
    """The model's name for every protocol (OpenAI's `model`, KServe's); empty:
    `kserve_model_name`. See `model_name`."""
    http_port: int | None = None
    """Serve the OpenAI-compatible HTTP API on this port (0: any free port); None: no HTTP.
    See docs/openai.md."""
    http_header_timeout_s: float = 60.0
    """HTTP: seconds a client has to send a request's headers; also how long an idle
    keep-alive connection stays open. Past it the connection is closed (slowloris)."""
    http_body_timeout_s: float = 60.0
    """HTTP: seconds a client has to send a request's body once its headers are in; past it
    the request gets 408 and the connection is closed."""
    otlp_traces_endpoint: str = ""
    """Export one OpenTelemetry span per request to this OTLP endpoint (e.g.
    `http://127.0.0.1:4317`); empty: no tracing. See cadence.core.tracing."""

    @property
    def model_name(self) -> str:
        """The name the model is served under: `served_model_name`, else `kserve_model_name`."""
        return self.served_model_name or self.kserve_model_name

    def __post_init__(self) -> None:
        problems = []
        if self.max_concurrent < 1:
            problems.append(f"max_concurrent must be at least 1 (got {self.max_concurrent})")
        if self.queue_capacity < 1:
            problems.append(f"queue_capacity must be at least 1 (got {self.queue_capacity})")
        if self.overflow not in ("merge", "block", "abort"):
            problems.append(f"overflow must be 'merge', 'block' or 'abort' (got {self.overflow!r})")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            problems.append("stall_timeout_s must be positive")
        for name in ("http_header_timeout_s", "http_body_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive (got {getattr(self, name)})")
        if self.accept_ahead < 0:
            problems.append(f"accept_ahead must be 0 or more (got {self.accept_ahead})")
        if self.max_message_bytes < 1024:
            problems.append("max_message_bytes must be at least 1024")
        if self.transport not in ("ipc", "tcp"):
            problems.append(f"transport must be 'ipc' or 'tcp' (got {self.transport!r})")
        if self.launcher not in ("local", "ray"):
            problems.append(f"launcher must be 'local' or 'ray' (got {self.launcher!r})")
        elif self.launcher == "ray" and self.transport != "tcp":
            problems.append("--launcher ray needs --transport tcp (workers on other hosts "
                            "cannot reach ipc sockets)")
        elif self.launcher == "ray" and (self.fronts > 1 or self.app_in_front):
            problems.append("--launcher ray runs one front with no in-front app "
                            "(drop --fronts / --app-in-front)")
        if self.launcher != "ray" and (self.ray_address or self.dist_ifname):
            problems.append("--ray-address and --dist-ifname need --launcher ray")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            problems.append("heartbeat_interval_s must be positive and below heartbeat_timeout_s "
                            f"(got {self.heartbeat_interval_s:g} and {self.heartbeat_timeout_s:g})")
        if not self.devices:
            problems.append("devices must name at least one device")
        if self.engine.max_batch < 1:
            problems.append(f"max_batch must be at least 1 (got {self.engine.max_batch})")
        for name in ("step_ms", "per_seq_ms", "prefill_ms_per_token", "jitter_ms", "first_step_ms"):
            if getattr(self.engine, name) < 0:
                problems.append(f"{name} must not be negative")
        by_worker = self.engine.step_ms_by_worker
        if by_worker and (len(by_worker) != len(self.devices) or min(by_worker) < 0):
            problems.append(f"step_ms_by_worker needs one step (>= 0 ms) per worker: "
                            f"{len(self.devices)} workers, got {len(by_worker)} value(s)")
        if self.engine.name == "app" and not self.engine.app:
            problems.append("the app engine needs a function: --app MODULE:FUNCTION")
        if self.engine.name == "model" and ":" not in self.engine.model_class:
            problems.append("the model engine needs a class: --engine MODULE:CLASS (got "
                            f"{self.engine.model_class!r})")
        if self.engine.max_step_tokens < 0 or self.engine.itl_target_ms < 0:
            problems.append("max_step_tokens and itl_target_ms must not be negative")
        elif self.engine.max_step_tokens and self.engine.itl_target_ms:
            problems.append("--max-step-tokens and --itl-target-ms are two ways to set one "
                            "step budget: give one")
        elif self.engine.name == "app" and (self.engine.max_step_tokens
                                            or self.engine.itl_target_ms):
            problems.append("--max-step-tokens and --itl-target-ms need a step engine (an app "
                            "function has no steps)")
        if self.engine.batch_timeout_ms < 0:
            problems.append(f"batch_timeout_ms must not be negative "
                            f"(got {self.engine.batch_timeout_ms})")
        if self.engine.engine_threads < 1:
            problems.append(f"engine_threads must be at least 1 (got {self.engine.engine_threads})")
        if self.app_in_front and self.engine.name != "app":
            problems.append("app_in_front needs the app engine (--app MODULE:FUNCTION)")
        problems.extend(_torch_problems(self))
        if self.grpc_server not in ("aio", "native"):
            problems.append(f"grpc_server must be aio or native (got {self.grpc_server!r})")
        elif self.grpc_server == "native" and self.launcher != "local":
            problems.append("--grpc-server native runs local workers only: drop --launcher, "
                            "or use --grpc-server aio")
        if self.fronts < 1:
            problems.append(f"fronts must be at least 1 (got {self.fronts})")
        elif self.fronts > 1 and self.transport != "ipc":
            problems.append("--fronts above 1 needs --transport ipc")
        elif self.fronts > 1 and self.app_in_front:
            problems.append("--fronts above 1 cannot run the app in the front (--app-in-front)")
        if self.max_tokens_limit < 1 or self.max_prompt_tokens < 1:
            problems.append("max_tokens_limit and max_prompt_tokens must be at least 1")
        if not self.kserve_model_name.strip():
            problems.append("kserve_model_name must not be empty")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            problems.append(f"http_port must be 0 (any free port) to 65535 (got {self.http_port})")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("--tls-cert and --tls-key go together: give both to serve over TLS")
        if self.tls_client_ca is not None and self.tls_cert is None:
            problems.append("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too")
        if problems:
            raise ValueError("; ".join(problems))


def _torch_problems(config: ServerConfig) -> list[str]:
    engine = config.engine
    problems = []
    if engine.name in ("torch", "transformers"):
        if not engine.model:
            problems.append(f"the {engine.name} engine needs a model: --model PATH (a local "
                            "Hugging Face folder)" + (" or --model tiny" if engine.name == "torch"
                                                      else ""))
        if engine.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype must be auto, float32, bfloat16 or float16 (got {engine.dtype!r})")
    if engine.name == "torch":
        if engine.cuda_graph_batch < 0:
            problems.append(f"cuda_graph_batch must be 0 (off) or more (got {engine.cuda_graph_batch})")
        if engine.kv_cache_tokens < 16:
            problems.append(f"kv_cache_tokens must be at least 16 (got {engine.kv_cache_tokens})")
    elif any("," in d for d in config.devices) and engine.name != "model":
        problems.append("tensor parallelism (--tp) needs the torch engine or a model class "
                        "(--engine MODULE:CLASS)")
    return problems


def group_devices(devices: list[str], tp: int) -> list[str]:
    """Group a flat device list into tensor-parallel workers of `tp` ranks each:
    `["cpu"] * 4, tp=2` → `["cpu,cpu", "cpu,cpu"]` (two replicas of two ranks)."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if tp == 1:
        return devices
    if len(devices) % tp:
        raise ValueError(
            f"--tp {tp} needs a multiple of {tp} devices; --devices gives {len(devices)}"
        )
    return [",".join(devices[i : i + tp]) for i in range(0, len(devices), tp)]


def cpu_threads_per_rank(devices: list[str]) -> int:
    """Torch threads for each CPU rank, so that all CPU ranks together use every core once."""
    import os

    ranks = sum(d.count("cpu") for d in devices)
    return max(1, (os.cpu_count() or 1) // ranks) if ranks else 0


def parse_devices(text: str) -> list[str]:
    """`cpu:N` → N CPU workers; `cuda:0,1` → one worker per listed card; `auto` → every
    visible CUDA card, or one CPU worker when there is none."""
    text = text.strip()
    if text == "auto":
        count = _cuda_device_count()
        return [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
    kind, _, rest = text.partition(":")
    if kind == "cpu":
        try:
            count = int(rest) if rest else 1
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"--devices cpu:N needs N >= 1, got {text!r}")
        return ["cpu"] * count
    if kind == "cuda":
        try:
            ids = [int(i) for i in rest.split(",") if i.strip()] if rest else [0]
        except ValueError:
            ids = []
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"--devices cuda:I,J,... needs distinct card numbers, got {text!r}")
        return [f"cuda:{i}" for i in ids]
    raise ValueError(f"--devices must be cpu:N, cuda:I,J,... or auto; got {text!r}")


def _cuda_device_count() -> int:
    # torch's count, not NVML's: NVML lists every physical card whatever
    # CUDA_VISIBLE_DEVICES says, and `auto` must give only the cards workers can open.
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0
