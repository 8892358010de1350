"""Configuration: the server's (`ServerConfig`), built once from the command line or by a
program, and what each worker is launched with (`WorkerSpec`, `EngineConfig`).

Each option of `cadence serve` is stated here once, on its field: its type, default, choices
(a `Literal`) and, as an `Option`, its help. The command line's flags are generated from these
declarations (cadence.cli), `cadence.serve(**options)` is checked against them
(cadence.serving), and both build their ServerConfig with `server_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

import msgspec

from cadence.wording import counted

GENERAL = ""
"""The section of the help that lists the options with no section of their own."""
ENGINE = "the engine (what generates the tokens)"
SYNTHETIC = "the synthetic engine (a model of an engine's timing)"
STREAMS = "requests and streams"
WORKERS = "workers"
PLACEMENT = "placement on other hosts (see docs/ray.md)"
SECURITY = "security (see docs/architecture.md#security)"
HTTP = "the OpenAI-compatible HTTP API (see docs/openai.md)"


@dataclasses.dataclass(frozen=True)
class Option:
    """A config field as an option of `cadence serve` (a flag) and of `cadence.serve()` (a
    keyword: the field's name), declared on the field (`Annotated[type, Option(...)]`), so the
    field's type, default and choices are the flag's."""

    help: str
    """The flag's help. `{default}` in it stands for the default; a help that does not speak
    of its default gets "(default: ...)" added."""
    section: str = GENERAL
    flag: str = ""
    """The flag, when it is not the field's name (less a trailing `_s`) with dashes."""
    aliases: tuple[str, ...] = ()
    """More flags for the same option."""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    """The flag's text to the field's value (raises ValueError); default: the field's type."""
    show: Callable[[Any], str] | None = None
    """How the default reads in the help, when not as the field's value does."""
    python: bool = True
    """Also a keyword of `cadence.serve()` (False: its `app` argument decides it)."""
    at_least: float | None = None
    """The smallest value accepted (None: no lower bound, or `above`)."""
    above: float | None = None
    """A value must be greater than this: a duration that must be positive is `above=0`."""
    at_most: float | None = None
    """The largest value accepted."""
    # Every number is checked against its bounds in one place (`_bound_problems`), and every
    # float must be finite: NaN passes no comparison, so an unchecked one starts a broken
    # server (a NaN drain timeout, a NaN step), and no option here means anything by infinity
    # (a timer that never fires is 0 or unset, as each option says).

    def problem(self, name: str, value: Any) -> str | None:
        """What is wrong with `value` for the field `name`, or None. None values (an option
        that is off) and switches are not numbers to check."""
        if value is None or isinstance(value, bool | str):
            return None
        if isinstance(value, tuple | list):
            return next(filter(None, (self.problem(name, v) for v in value)), None)
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} must be a finite number (got {shown})"
        if (
            self.at_least is not None
            and self.at_most is not None
            and not (self.at_least <= value <= self.at_most)
        ):
            return f"{name} must be {self.at_least:g} to {self.at_most:g} (got {shown})"
        if self.at_least is not None and value < self.at_least:
            return (
                f"{name} must not be negative (got {shown})"
                if self.at_least == 0
                else f"{name} must be at least {self.at_least:g} (got {shown})"
            )
        if self.above is not None and not value > self.above:
            return (
                f"{name} must be positive (got {shown})"
                if self.above == 0
                else f"{name} must be above {self.above:g} (got {shown})"
            )
        return None


PORT = {"at_least": 0, "at_most": 65535}
"""A TCP port's bounds (0: any free one)."""
POSITIVE = {"above": 0}
NOT_NEGATIVE = {"at_least": 0}


def _engine_name(text: str) -> str:
    kinds = ("synthetic", "app", "torch", "transformers")
    if text in kinds or ":" in text:
        return text
    raise ValueError(
        f"invalid choice: {text!r} (choose from {', '.join(kinds)}, or "
        "MODULE:CLASS for your batched model class)"
    )


def _step_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"expected MS,MS,... (numbers), got {text!r}") from None


def _seconds_or_never(text: str) -> float | None:
    """Seconds; 0 turns the timer off (None)."""
    try:
        return float(text) or None
    except ValueError:
        raise ValueError(f"invalid float value: {text!r}") from None


PREFIX_CACHING_BY_DEFAULT: tuple[str, ...] = ("torch",)
"""The engines whose prefix caching is on unless --no-prefix-caching: those with a prefix
cache of their own, whose cost where no prompt shares a prefix is measured by
benchmarks/prefix_caching_cost.py (results/prefix_caching_cost.json, docs/models.md). The
synthetic engine's is a model of the torch engine's, asked for by --prefix-caching, so that a
lab run's modelled timing does not change under it."""


def _prefix_caching_default(_: object) -> str:
    engines = " and ".join(PREFIX_CACHING_BY_DEFAULT)
    return f"on with the {engines} engine, off otherwise" if engines else "off"


def _threads_default(_: object) -> str:
    return (
        "the host's cores shared among the CPU ranks, less one core left to the front where "
        "the host has more cores than ranks"
    )


Role = Literal["", "prefill", "decode"]
"""A worker's part in disaggregated serving ("": both prefill and decode)."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker needs to build its engine. Sent once, as JSON, at start-up."""

    name: Annotated[
        str,
        Option(
            "what generates the tokens: a synthetic model of an engine's timing, your generator "
            "function (--app), a Llama model in torch (--model), any causal LM that transformers "
            "loads (transformers --model PATH), or your batched model class (docs/models.md)",
            ENGINE,
            flag="--engine",
            metavar="{synthetic,app,torch,transformers,MODULE:CLASS}",
            parse=_engine_name,
            python=False,
        ),
    ] = "synthetic"
    """Engine kind: `synthetic`, `app` (a user's generator function), `torch` (a Llama model),
    `model` (a user's batched model class, `model_class`) or `transformers` (any causal LM
    that transformers loads from `model`, served as a model class)."""
    step_ms: Annotated[float, Option("synthetic decode step (ms)", SYNTHETIC, **NOT_NEGATIVE)] = (
        20.0
    )
    per_seq_ms: Annotated[
        float, Option("synthetic cost per sequence in a step (ms)", SYNTHETIC, **NOT_NEGATIVE)
    ] = 0.0
    prefill_ms_per_token: Annotated[
        float, Option("synthetic prefill cost (ms/token)", SYNTHETIC, **NOT_NEGATIVE)
    ] = 0.01
    jitter_ms: Annotated[
        float,
        Option(
            "synthetic step jitter: standard deviation of Gaussian noise on each step, clipped at "
            "0 (ms)",
            SYNTHETIC,
            **NOT_NEGATIVE,
        ),
    ] = 0.0
    first_step_ms: Annotated[
        float,
        Option(
            "extra time on each worker's first step, a cold start (ms)", SYNTHETIC, **NOT_NEGATIVE
        ),
    ] = 0.0
    step_ms_by_worker: Annotated[
        tuple[float, ...],
        Option(
            "synthetic: each worker's decode step, one per worker in --devices order, to model "
            "cards of different speeds (overrides --step-ms)",
            SYNTHETIC,
            metavar="MS,MS,...",
            parse=_step_list,
            **NOT_NEGATIVE,
        ),
    ] = ()
    seed: Annotated[int, Option("seed of the synthetic engine's tokens and jitter", SYNTHETIC)] = 0
    handoff_bytes_per_token: Annotated[
        int,
        Option(
            "synthetic, disaggregated serving: KV-cache bytes a prompt token's state takes when "
            "it moves from a prefill worker to a decode worker (default {default}: a Llama-3-8B "
            "token in 16 bits)",
            SYNTHETIC,
            metavar="BYTES",
            **NOT_NEGATIVE,
        ),
    ] = 131072
    handoff_gbps: Annotated[
        float,
        Option(
            "synthetic, disaggregated serving: the hand-off's bandwidth in GB/s (default "
            "{default}: a PCIe 4.0 x16 link); a prefill worker spends bytes / bandwidth on each "
            "state it exports",
            SYNTHETIC,
            metavar="GB/S",
            **POSITIVE,
        ),
    ] = 25.0
    max_batch: Annotated[
        int,
        Option(
            "sequences per engine step at most; more wait in the worker's queue", ENGINE, at_least=1
        ),
    ] = 512
    app: Annotated[
        str,
        Option(
            "serve your generator function (sync or async; implies --engine app)",
            ENGINE,
            metavar="MODULE:FUNCTION",
            python=False,
        ),
    ] = ""
    """App engine: the user's generator function as `module:function` or `path.py:function`."""
    model_class: str = ""
    """Model engine: the user's batched model class as `module:Class` or `path.py:Class`
    (cadence.engines.user_model; docs/models.md)."""
    batch_timeout_ms: Annotated[
        float,
        Option(
            "MODULE:CLASS with generate_stream(batch): how long the first waiting request waits "
            "for others to fill a batch before it starts",
            ENGINE,
            metavar="MS",
            **NOT_NEGATIVE,
        ),
    ] = 10.0
    engine_threads: Annotated[
        int,
        Option(
            "app engine, sync function: executor threads per worker (default {default}, one per "
            "device)",
            ENGINE,
            at_least=1,
        ),
    ] = 1
    model: Annotated[
        str,
        Option(
            "torch engine: a local Hugging Face Llama folder, or tiny (implies --engine torch); "
            "--engine transformers and MODULE:CLASS: the folder the model loads",
            ENGINE,
            metavar="PATH|tiny",
        ),
    ] = ""
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Option(
            "torch and transformers engines: compute dtype (auto: float32 on CPU, the "
            "checkpoint's on CUDA)",
            ENGINE,
        ),
    ] = "auto"
    kv_cache_tokens: Annotated[
        int,
        Option(
            "torch engine: KV cache capacity per worker, in tokens of all sequences together",
            ENGINE,
            at_least=16,
        ),
    ] = 16384
    cuda_graph_batch: Annotated[
        int,
        Option(
            "torch engine on CUDA, --tp 1: decode steps of up to N sequences replay captured CUDA "
            "graphs (default {default}; 0 turns them off)",
            ENGINE,
            **NOT_NEGATIVE,
        ),
    ] = 32
    threads: Annotated[
        int,
        Option(
            "torch and transformers engines on CPU: torch's intra-op threads per rank "
            "(torch.set_num_threads; 0 leaves the number to torch) (default: {default})",
            ENGINE,
            metavar="N",
            show=_threads_default,
            **NOT_NEGATIVE,
        ),
    ] = 0
    """Torch and transformers on CPU: intra-op threads per rank; 0 leaves torch's default.
    Not given: `cpu_threads_per_rank` (set when the config is built)."""
    max_step_tokens: Annotated[
        int,
        Option(
            "a step's token budget (decoded sequences + prompt tokens prefilled): long prompts are "
            "prefilled in chunks beside the decodes, by engines that take chunks (torch, "
            "synthetic; model classes that opt in) (default: no budget, each prompt whole in one "
            "step)",
            ENGINE,
            metavar="N",
            **NOT_NEGATIVE,
        ),
    ] = 0
    """See cadence.worker.step_budget."""
    itl_target_ms: Annotated[
        float,
        Option(
            "a step's budget from the worker's own measured step-time model, so a step stays "
            "within MS while long prompts are prefilled in chunks (default: off; instead of "
            "--max-step-tokens)",
            ENGINE,
            metavar="MS",
            **NOT_NEGATIVE,
        ),
    ] = 0.0
    prefix_caching: Annotated[
        bool | None,
        Option(
            "keep finished sequences' KV blocks for later requests that start the same way "
            "(torch; the synthetic engine models it), and route a request to the worker that "
            "holds its longest prefix (--routing); --no-prefix-caching turns it off "
            "(default: {default})",
            ENGINE,
            show=_prefix_caching_default,
        ),
    ] = None
    """Torch: full KV blocks keyed by the chained hash of their tokens, shared read-only,
    evicted LRU (cadence.engines.llama.kv_cache); synthetic: a remembered prefix costs no
    prefill time. None (not given): on for the engines in PREFIX_CACHING_BY_DEFAULT, a bool
    once the config is built."""
    preempt: Annotated[
        bool,
        Option(
            "a waiting request that finds the batch or the KV cache full preempts the running "
            "sequence of the lowest priority below its own (recomputed later; its stream only "
            "waits)",
            ENGINE,
        ),
    ] = False
    """Lower priority: a higher `priority` value. Engines with `preempt` (torch, synthetic)."""

    @property
    def tokenizes_text(self) -> bool:
        """Text prompts go to the worker, which tokenizes them with the model's tokenizer."""
        return self.name in ("torch", "model", "transformers")

    @property
    def text_beside_bytes(self) -> bool:
        """A text prompt goes as its UTF-8 bytes (the front counts and checks them) and as
        text too, for an app function with its own tokenizer to encode (the app engine)."""
        return self.name == "app"

    def __post_init__(self) -> None:
        if self.prefix_caching is None:  # not given: on where the engine has a prefix cache
            msgspec.structs.force_setattr(
                self, "prefix_caching", self.name in PREFIX_CACHING_BY_DEFAULT
            )


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
    heartbeat_timeout_s: float = 5.0
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
    max_prompt_tokens: int = 65536
    """--max-prompt-tokens, for the prompts the worker tokenizes (text to a model's own
    tokenizer); the front checks those it tokenizes itself."""
    max_failed_steps: int = 5
    """--worker-max-failed-steps: after this many failed engine steps in a row the worker
    tells every front (`StepsFailing`); 0: never."""
    role: Role = ""
    """Disaggregated serving (`--prefill-devices`, `--decode-devices`): a prefill worker hands
    each sequence's state to the front after its first token (`StateExport`); a decode worker
    also takes states in (`WorkerInputs.imports`). Empty: a worker that does both."""


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: Annotated[str, Option("address to bind")] = "127.0.0.1"
    port: Annotated[int, Option("port to bind; 0 picks a free one", **PORT)] = 50051
    devices: Annotated[
        list[str],
        Option(
            "one worker per device: cpu:N, cuda:I,J,... or auto (every visible card, else one CPU "
            "worker)",
            parse=str,
            show=lambda devices: f"cpu:{len(devices)}",
        ),
    ] = msgspec.field(default_factory=lambda: ["cpu"])
    """One worker per entry: `cpu` or `cuda:N`; a tensor-parallel worker lists one device per
    rank, comma separated (see `group_devices`)."""
    prefill_devices: Annotated[
        list[str],
        Option(
            "disaggregated serving: workers that prefill prompts and give each request's first "
            "token, then hand its state to a decode worker (cpu:N or cuda:I,J,...; with "
            "--decode-devices, in place of --devices; docs/architecture.md#disaggregated-serving)",
            WORKERS,
            metavar="DEVICES",
            parse=str,
            show=lambda devices: "none",
        ),
    ] = []
    """The first `len(prefill_devices)` entries of `devices` (grouped as `devices` is)."""
    decode_devices: Annotated[
        list[str],
        Option(
            "disaggregated serving: workers that take the states prefill workers hand off and "
            "stream the rest of each request (and serve prompts up to --disaggregate-above "
            "whole)",
            WORKERS,
            metavar="DEVICES",
            parse=str,
            show=lambda devices: "none",
        ),
    ] = []
    """The last `len(decode_devices)` entries of `devices`."""
    disaggregate_above: Annotated[
        int,
        Option(
            "disaggregated serving: a prompt of more than this many tokens is prefilled on a "
            "prefill worker and handed off; a shorter one runs whole on a decode worker",
            WORKERS,
            metavar="TOKENS",
            **NOT_NEGATIVE,
        ),
    ] = 256
    """A prompt the worker tokenizes (text to a model's own tokenizer) counts its characters."""
    handoff_window: Annotated[
        int,
        Option(
            "disaggregated serving: states sent to one decode worker ahead of its taking them "
            "into its batch; the rest wait in the front (back-pressure)",
            WORKERS,
            metavar="N",
            at_least=1,
        ),
    ] = 4
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    max_concurrent: Annotated[
        int,
        Option(
            "streams admitted at once; more are refused with RESOURCE_EXHAUSTED",
            STREAMS,
            at_least=1,
        ),
    ] = 1024
    queue_capacity: Annotated[
        int,
        Option(
            "steps of output a request's buffer holds before --overflow applies",
            STREAMS,
            at_least=1,
        ),
    ] = 64
    overflow: Annotated[
        Literal["merge", "block", "abort"],
        Option(
            "when a client lags past --queue-capacity: merge its tokens, pause its sequence in the "
            "engine, or end its stream",
            STREAMS,
        ),
    ] = "merge"
    """See cadence.core.stream."""
    idle_connection_timeout_s: Annotated[
        float,
        Option(
            "seconds a client connection with no call open stays open; then the server closes it "
            "(gRPC: a GOAWAY, on grpc.aio and native alike; HTTP: the shorter of this and "
            "--http-header-timeout)",
            STREAMS,
            metavar="S",
            **POSITIVE,
        ),
    ] = 60.0
    """An idle connection costs the server a socket and its buffers (on native, Envoy's, whose
    own default is an hour); a client's channel reconnects when it next calls."""
    stall_timeout_s: Annotated[
        float | None,
        Option(
            "cut off a client that reads nothing for this many seconds: its stream ends with an "
            "error (HTTP: an error event and [DONE], then the connection closes) (default: never)",
            STREAMS,
            metavar="S",
            **POSITIVE,
        ),
    ] = None
    max_message_bytes: Annotated[
        int, Option("largest request message accepted", STREAMS, at_least=1024)
    ] = 4 * 1024 * 1024
    accept_ahead: Annotated[
        int,
        Option(
            "new calls of each streaming method requested from gRPC ahead of their arrival, so a "
            "burst of calls is taken in while other streams keep the front busy (0: grpc.aio's "
            "own accept loop, one at a time)",
            STREAMS,
            metavar="N",
            **NOT_NEGATIVE,
        ),
    ] = 64
    """See cadence.net.call_acceptor."""
    max_tokens_limit: Annotated[
        int,
        Option(
            "largest max_tokens a request may ask for (INVALID_ARGUMENT above)", STREAMS, at_least=1
        ),
    ] = 16384
    max_prompt_tokens: Annotated[
        int,
        Option("longest prompt accepted, in tokens (INVALID_ARGUMENT above)", STREAMS, at_least=1),
    ] = 65536
    metrics_port: Annotated[
        int | None,
        Option(
            "serve Prometheus metrics on this port (0: any free port), on --host, over plain HTTP "
            "with no TLS and no token: anyone who can reach it reads them (default: off)",
            metavar="PORT",
            **PORT,
        ),
    ] = None
    transport: Annotated[
        Literal["ipc", "tcp"],
        Option(
            "front <-> worker sockets: ipc (one host) or tcp (CURVE-encrypted) (default ipc; tcp "
            "with --launcher ray)",
            WORKERS,
        ),
    ] = "ipc"
    worker_host: Annotated[
        str,
        Option(
            "tcp: the address the front binds for its workers (default 127.0.0.1; the Ray node's "
            "IP with --launcher ray)",
            WORKERS,
            metavar="ADDR",
        ),
    ] = ""
    launcher: Annotated[
        Literal["local", "ray"],
        Option("start workers as child processes (local) or as Ray actors", PLACEMENT),
    ] = "local"
    ray_address: Annotated[
        str,
        Option(
            "Ray cluster to join (HOST:PORT or auto); default: a Ray instance on this host",
            PLACEMENT,
            metavar="ADDR",
        ),
    ] = ""
    dist_ifname: Annotated[
        str,
        Option(
            "network interface torch.distributed uses between hosts, GLOO_SOCKET_IFNAME and "
            "NCCL_SOCKET_IFNAME (default: the one carrying each Ray node's IP)",
            PLACEMENT,
            metavar="IFNAME",
        ),
    ] = ""
    heartbeat_interval_s: Annotated[
        float,
        Option("front <-> worker heartbeat period in seconds", WORKERS, metavar="S", **POSITIVE),
    ] = 0.1
    heartbeat_timeout_s: Annotated[
        float,
        Option(
            "a worker silent this long is restarted; a worker that hears no front this long exits",
            WORKERS,
            metavar="S",
            **POSITIVE,
        ),
    ] = 5.0
    startup_timeout_s: Annotated[
        float,
        Option(
            "seconds every worker gets to load its engine and report ready",
            WORKERS,
            metavar="S",
            **POSITIVE,
        ),
    ] = 60.0
    worker_timeout_s: Annotated[
        float | None,
        Option(
            "seconds without a step (while requests are open) before a worker counts as hung and "
            "is restarted; 0 disables",
            WORKERS,
            metavar="S",
            parse=_seconds_or_never,
            **POSITIVE,
        ),
    ] = 60.0
    worker_max_failed_steps: Annotated[
        int,
        Option(
            "a worker whose last N engine steps all failed (a sticky device error: each step "
            "raises) is taken out of routing and restarted, with the restarts' back-off; 0 disables",
            WORKERS,
            metavar="N",
            at_least=0,
        ),
    ] = 5
    """The way Envoy's outlier detection ejects a host after consecutive errors: a worker
    failing every step fails its requests at once, so least-loaded routing would send it
    nearly all of them."""
    restart_workers: Annotated[
        bool,
        Option(
            "do not restart workers that die (their streams fail with UNAVAILABLE)",
            WORKERS,
            flag="--no-restart",
        ),
    ] = True
    """Restart a worker that died, with back-off; its streams fail with UNAVAILABLE."""
    drain_timeout_s: Annotated[
        float,
        Option(
            "on SIGINT/SIGTERM, seconds open streams get to finish before they end with "
            "UNAVAILABLE",
            aliases=("--grace",),
            metavar="S",
            **NOT_NEGATIVE,
        ),
    ] = 5.0
    app_in_front: Annotated[
        bool,
        Option(
            "run the app in the front process instead of worker processes (shared in-process "
            "state; shares the front's GIL; docs/apps.md)",
            ENGINE,
        ),
    ] = False
    tls_cert: Annotated[
        str | None,
        Option(
            "serve TLS only, with this certificate chain (needs --tls-key)", SECURITY, metavar="PEM"
        ),
    ] = None
    tls_key: Annotated[str | None, Option("the key of --tls-cert", SECURITY, metavar="PEM")] = None
    tls_client_ca: Annotated[
        str | None,
        Option(
            "mutual TLS: require client certificates signed by this CA", SECURITY, metavar="PEM"
        ),
    ] = None
    auth_token_file: Annotated[
        str | None,
        Option(
            "require 'authorization: Bearer <token>' with a token from FILE (one per line) on "
            "every RPC but health",
            SECURITY,
            metavar="FILE",
        ),
    ] = None
    """See cadence.api.security."""
    grpc_server: Annotated[
        Literal["aio", "native"],
        Option(
            "aio: grpc.aio (default); native: gRPC on Envoy's HTTP/2 through pyvoy (the front runs "
            "inside Envoy, one Envoy per front; local workers only; needs cadence[native]; see "
            "docs/native-grpc.md)"
        ),
    ] = "aio"
    """See cadence.lifecycle.envoy_front."""
    fronts: Annotated[
        int,
        Option(
            "front processes sharing the port (SO_REUSEPORT), each connected to every worker; the "
            "first also launches the workers and the other fronts",
            at_least=1,
        ),
    ] = 1
    """See docs/architecture.md#fronts."""
    routing: Annotated[
        Literal["prefix", "load"],
        Option(
            "prefix: with --prefix-caching, prefer the worker that holds the longest prefix of the "
            "prompt; load: least outstanding work only",
            WORKERS,
        ),
    ] = "prefix"
    """See cadence.router.worker_router (without prefix caching: load)."""
    prefix_routing_slack: Annotated[
        int,
        Option(
            "a worker with more than K open requests beyond the least loaded loses the preference "
            "its cached prefix gives it",
            WORKERS,
            metavar="K",
            **NOT_NEGATIVE,
        ),
    ] = 4
    kserve_model_name: Annotated[
        str,
        Option(
            "the model's name in the Open Inference Protocol (KServe v2 / Triton gRPC, same port; "
            "docs/kserve.md)",
            metavar="NAME",
        ),
    ] = "cadence"
    served_model_name: Annotated[
        str,
        Option(
            "the model's name for every protocol: OpenAI's model (GET /v1/models) and KServe's "
            "(default: --kserve-model-name's)",
            metavar="NAME",
        ),
    ] = ""
    """See `model_name`."""
    http_port: Annotated[
        int | None,
        Option(
            "also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
            "/v1/models, /health) on this port; 0 picks a free one (default: off)",
            HTTP,
            metavar="PORT",
            **PORT,
        ),
    ] = None
    http_header_timeout_s: Annotated[
        float,
        Option(
            "HTTP: seconds a client has to send a request's headers, and an idle keep-alive "
            "connection stays open; then the connection is closed (slowloris)",
            HTTP,
            metavar="S",
            **POSITIVE,
        ),
    ] = 60.0
    http_body_timeout_s: Annotated[
        float,
        Option(
            "HTTP: seconds a client has to send a request's body once its headers are in; then "
            "408 and the connection is closed",
            HTTP,
            metavar="S",
            **POSITIVE,
        ),
    ] = 60.0
    otlp_traces_endpoint: Annotated[
        str,
        Option(
            "export one OpenTelemetry span per request (every protocol) to this OTLP/gRPC "
            "endpoint, e.g. http://127.0.0.1:4317; needs cadence[otel] (default: "
            "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT when set, else "
            "off)",
            metavar="URL",
        ),
    ] = ""
    """See cadence.core.tracing."""

    @property
    def model_name(self) -> str:
        """The name the model is served under: `served_model_name`, else `kserve_model_name`."""
        return self.served_model_name or self.kserve_model_name

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode run on different workers (`--prefill-devices`)."""
        return bool(self.prefill_devices)

    @property
    def roles(self) -> list[Role]:
        """Each worker's role, in `devices` order (all empty when not disaggregated)."""
        if not self.prefill_devices:
            return [""] * len(self.devices)
        prefill = len(self.prefill_devices)
        roles: list[Role] = ["prefill"] * prefill
        return roles + ["decode"] * (len(self.devices) - prefill)

    def __post_init__(self) -> None:
        problems = [
            *_choice_problems(self),
            *_choice_problems(self.engine),
            *_bound_problems(self),
            *_bound_problems(self.engine),
        ]
        if self.launcher == "ray" and self.transport != "tcp":
            problems.append(
                "--launcher ray needs --transport tcp (workers on other hosts "
                "cannot reach ipc sockets)"
            )
        elif self.launcher == "ray" and (self.fronts > 1 or self.app_in_front):
            problems.append(
                "--launcher ray runs one front with no in-front app "
                "(drop --fronts / --app-in-front)"
            )
        if self.launcher != "ray" and (self.ray_address or self.dist_ifname):
            problems.append("--ray-address and --dist-ifname need --launcher ray")
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            problems.append(
                "heartbeat_interval_s must be below heartbeat_timeout_s "
                f"(got {self.heartbeat_interval_s:g} and {self.heartbeat_timeout_s:g})"
            )
        if not self.devices:
            problems.append("devices must name at least one device")
        by_worker = self.engine.step_ms_by_worker
        if by_worker and len(by_worker) != len(self.devices):
            problems.append(
                f"step_ms_by_worker needs one step (>= 0 ms) per worker: "
                f"{counted(len(self.devices), 'worker')}, got {counted(len(by_worker), 'value')}"
            )
        if self.engine.name == "app" and not self.engine.app:
            problems.append("the app engine needs a function: --app MODULE:FUNCTION")
        if self.engine.name == "model" and ":" not in self.engine.model_class:
            problems.append(
                "the model engine needs a class: --engine MODULE:CLASS (got "
                f"{self.engine.model_class!r})"
            )
        if self.engine.max_step_tokens and self.engine.itl_target_ms:
            problems.append(
                "--max-step-tokens and --itl-target-ms are two ways to set one "
                "step budget: give one"
            )
        elif self.engine.name == "app" and (
            self.engine.max_step_tokens or self.engine.itl_target_ms
        ):
            problems.append(
                "--max-step-tokens and --itl-target-ms need a step engine (an app "
                "function has no steps)"
            )
        if self.app_in_front and self.engine.name != "app":
            problems.append("app_in_front needs the app engine (--app MODULE:FUNCTION)")
        problems.extend(_torch_problems(self))
        problems.extend(_disaggregation_problems(self))
        if self.grpc_server == "native" and self.launcher != "local":
            problems.append(
                "--grpc-server native runs local workers only: drop --launcher, "
                "or use --grpc-server aio"
            )
        if self.fronts > 1 and self.transport != "ipc":
            problems.append("--fronts above 1 needs --transport ipc")
        elif self.fronts > 1 and self.app_in_front:
            problems.append("--fronts above 1 cannot run the app in the front (--app-in-front)")
        if self.engine.name == "app" and (self.engine.prefix_caching or self.engine.preempt):
            problems.append(
                "--prefix-caching and --preempt need a step engine (an app function has no steps)"
            )
        if not self.kserve_model_name.strip():
            problems.append("kserve_model_name must not be empty")
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
            problems.append(
                f"the {engine.name} engine needs a model: --model PATH (a local "
                "Hugging Face folder)" + (" or --model tiny" if engine.name == "torch" else "")
            )
    if engine.name not in ("torch", "model") and any("," in d for d in config.devices):
        problems.append(
            "tensor parallelism (--tp) needs the torch engine or a model class "
            "(--engine MODULE:CLASS)"
        )
    return problems


def _disaggregation_problems(config: ServerConfig) -> list[str]:
    prefill, decode = config.prefill_devices, config.decode_devices
    if not prefill and not decode:
        return []
    if not prefill or not decode:
        return ["--prefill-devices and --decode-devices go together: give both"]
    problems = []
    if config.devices != [*prefill, *decode]:
        problems.append(
            "with --prefill-devices and --decode-devices the workers are theirs: drop --devices"
        )
    if config.engine.name == "app":
        problems.append(
            "disaggregated serving needs a step engine with export_state and import_state "
            "(an app function has no state to hand off)"
        )
    if config.fronts > 1:
        problems.append("disaggregated serving runs one front: drop --fronts")
    if any("," in d for d in [*prefill, *decode]):
        problems.append("disaggregated serving moves whole states: drop --tp")
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


def _role_devices(given: str | list[str], role: str) -> list[str]:
    """`--prefill-devices` or `--decode-devices` (`role`: the field) as a list of devices."""
    if not isinstance(given, str):
        return list(given)
    flag = "--" + role.replace("_", "-")
    try:
        return parse_devices(given)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--devices", flag)) from None


def cpu_threads_per_rank(devices: list[str]) -> int:
    """Torch threads for each CPU rank, so that all CPU ranks together use every core once,
    less one core left to the front (its event loop and the transport's threads) where the
    host has more cores than ranks: a rank whose threads fill every core makes the front
    wait for a CPU at each token, and a step wait for the front's turn (vLLM's CPU backend
    leaves the serving process a core the same way)."""
    import os

    ranks = sum(d.count("cpu") for d in devices)
    if not ranks:
        return 0
    cores = os.cpu_count() or 1
    return max(1, (cores - 1 if cores > ranks else cores) // ranks)


def parse_devices(text: str) -> list[str]:
    """`cpu:N` → N CPU workers; `cuda:0,1` → one worker per listed card; `auto` → every
    visible CUDA card, or one CPU worker when there is none."""
    text = text.strip()
    if text == "auto":
        count = cuda_device_count()
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


def cuda_device_count() -> int:
    # torch's count, not NVML's: NVML lists every physical card whatever
    # CUDA_VISIBLE_DEVICES says, and `auto` must give only the cards workers can open.
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _choice_problems(struct: msgspec.Struct) -> list[str]:
    """A field declared as a `Literal` holding none of its choices (a program's constructor
    checks no types; the command line and `cadence.serve()` convert, which does)."""
    problems = []
    for name, choices in _choices(type(struct)).items():
        value = getattr(struct, name)
        if value not in choices:
            *first, last = (repr(c) for c in choices)
            problems.append(f"{name} must be {', '.join(first)} or {last} (got {value!r})")
    return problems


def _bound_problems(struct: msgspec.Struct) -> list[str]:
    """Each declared option of `struct` whose value is not a finite number within the bounds
    its `Option` declares (`Option.problem`)."""
    return [
        problem
        for name, option in _options(type(struct)).items()
        if (problem := option.problem(name, getattr(struct, name))) is not None
    ]


@functools.cache
def _options(cls: type) -> dict[str, Option]:
    """The `Option` declared on each field of `cls` that has one."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {
        name: option
        for name, hint in hints.items()
        for option in getattr(hint, "__metadata__", ())
        if isinstance(option, Option)
    }


@functools.cache
def _choices(cls: type) -> dict[str, tuple]:
    return {
        name: typing.get_args(hint)
        for name, hint in typing.get_type_hints(cls).items()
        if typing.get_origin(hint) is Literal
    }


@dataclasses.dataclass(frozen=True)
class ServeOption:
    """One option of `cadence serve` and `cadence.serve()`, as its field declares it."""

    name: str
    """The field's name: `cadence.serve()`'s keyword, and where the flag's value goes."""
    kind: Any
    """The field's type."""
    default: Any
    option: Option

    @property
    def flags(self) -> tuple[str, ...]:
        first = self.option.flag or "--" + self.name.removesuffix("_s").replace("_", "-")
        if self.both_ways:
            return (first, "--no-" + first.removeprefix("--"), *self.option.aliases)
        return (first, *self.option.aliases)

    @property
    def both_ways(self) -> bool:
        """A switch whose default depends on other options (`bool | None`, None until the
        config is built): `--flag` turns it on, `--no-flag` off."""
        return self.kind == bool | None

    @property
    def choices(self) -> tuple | None:
        return typing.get_args(self.kind) if typing.get_origin(self.kind) is Literal else None


TENSOR_PARALLEL = ServeOption(
    "tp",
    int,
    1,
    Option(
        "torch engine or MODULE:CLASS: tensor-parallel ranks per worker; --devices cpu:4 --tp 2 "
        "gives two workers of two ranks"
    ),
)
"""The one option that is no field: it groups `devices` (see `group_devices`)."""


@functools.cache
def serve_options() -> tuple[ServeOption, ...]:
    """Every option of `cadence serve`, in the order of the fields that declare them."""
    return tuple(_declared(ServerConfig))


def _declared(cls: type) -> list[ServeOption]:
    hints = typing.get_type_hints(cls, include_extras=True)
    options = _options(cls)
    declared = []
    for field in msgspec.structs.fields(cls):
        if field.type is EngineConfig:
            declared += _declared(EngineConfig)
            continue
        option = options.get(field.name)
        if option is None:
            continue
        default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
        declared.append(
            ServeOption(field.name, typing.get_args(hints[field.name])[0], default, option)
        )
        if field.name == "devices":
            declared.append(TENSOR_PARALLEL)
    return declared


def unknown_options(names: Iterable[str]) -> str | None:
    """What is wrong with `names` as keywords of `cadence.serve()`: each that is not an option,
    with the options it may have meant; None when all are options."""
    options = serve_options()
    known = [o.name for o in options if o.option.python]
    given_by_app = {o.name for o in options if not o.option.python}
    # A keyword spelt as one of the option's flags (`grace` for --grace) points to its name.
    spellings = {name: name for name in known}
    for o in options:
        if o.option.python:
            for flag in o.flags:
                spellings.setdefault(flag.removeprefix("--").replace("-", "_"), o.name)
    problems = []
    for name in names:
        if name in given_by_app:
            problems.append(
                f"{name!r} is given by the app argument (a function, a class or its MODULE:NAME)"
            )
        elif name not in known:
            close = list(
                dict.fromkeys(
                    spellings[s] for s in difflib.get_close_matches(name, list(spellings), n=3)
                )
            )
            problems.append(
                f"unknown option {name!r}"
                + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")
            )
    return "; ".join(problems) or None


def server_config(options: Mapping[str, Any]) -> ServerConfig:
    """The ServerConfig of `cadence serve`'s options by name (`serve_options`; one not given
    takes its default), as the command line and `cadence.serve()` give them: `devices` as
    text is read (`parse_devices`) and grouped by `tp`; `app`, a MODULE:CLASS engine or a
    `model` name the engine; with `launcher="ray"` the transport is tcp unless given; the
    OTLP endpoint defaults to the environment's ($OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    $OTEL_EXPORTER_OTLP_ENDPOINT). Raises ValueError saying what is wrong."""
    from cadence.core.tracing import endpoint_from_env

    defaults = {o.name: o.default for o in serve_options()}
    server = dict(options)
    engine = {
        name: server.pop(name) for name in list(server) if name in EngineConfig.__struct_fields__
    }
    tp = server.pop("tp", defaults["tp"])
    devices = server.pop("devices", defaults["devices"])
    devices = group_devices(
        parse_devices(devices) if isinstance(devices, str) else list(devices), tp
    )
    roles = {}
    for role in ("prefill_devices", "decode_devices"):
        given = server.pop(role, None)
        if given:
            roles[role] = group_devices(_role_devices(given, role), tp)
    if roles:
        if "devices" in options:
            raise ValueError(
                "with --prefill-devices and --decode-devices the workers are theirs: drop --devices"
            )
        server.update(roles)
        devices = [*roles.get("prefill_devices", []), *roles.get("decode_devices", [])]
    name = engine.get("name", defaults["name"])
    if engine.get("app"):
        name = "app"
    elif ":" in name:  # --engine MODULE:CLASS
        name, engine["model_class"] = "model", name
    elif engine.get("model") and name == "synthetic":
        name = "torch"
    engine["name"] = name
    if name in ("torch", "transformers"):
        engine.setdefault("threads", cpu_threads_per_rank(devices))
    if "transport" not in server and server.get("launcher") == "ray":
        server["transport"] = "tcp"
    if not server.get("otlp_traces_endpoint"):
        server["otlp_traces_endpoint"] = endpoint_from_env()
    # convert, not the constructor: it checks every option's type.
    return msgspec.convert({**server, "devices": devices, "engine": engine}, ServerConfig)
