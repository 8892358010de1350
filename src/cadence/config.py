"""Server configuration: one typed object, built once from the command line or by a program."""

from __future__ import annotations

import msgspec

from cadence.transport.messages import EngineConfig


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 50051
    """0 asks the OS for a free port."""
    devices: list[str] = msgspec.field(default_factory=lambda: ["cpu"])
    """One worker per entry: `cpu` or `cuda:N`."""
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    max_concurrent: int = 1024
    """Streams admitted at once; more are refused with RESOURCE_EXHAUSTED."""
    queue_capacity: int = 64
    """Steps of output that may wait in a request's buffer before the overflow policy applies."""
    overflow: str = "merge"
    """`merge` or `abort`; see cadence.api.request_stream."""
    max_tokens_limit: int = 16384
    """Largest max_tokens a request may ask for."""
    max_prompt_tokens: int = 65536
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free port); None: no metrics endpoint."""
    transport: str = "ipc"
    """`ipc` (one host) or `tcp`."""
    startup_timeout_s: float = 60.0
    worker_timeout_s: float | None = 60.0
    """A worker with open requests that sends no step for this long is killed and restarted
    (None: never)."""
    restart_workers: bool = True
    """Restart a worker that died, with back-off; its streams fail with UNAVAILABLE."""
    grace_s: float = 5.0
    """On shutdown, open streams get this long to finish before they are cancelled."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_concurrent < 1:
            problems.append(f"max_concurrent must be at least 1 (got {self.max_concurrent})")
        if self.queue_capacity < 1:
            problems.append(f"queue_capacity must be at least 1 (got {self.queue_capacity})")
        if self.overflow not in ("merge", "abort"):
            problems.append(f"overflow must be 'merge' or 'abort' (got {self.overflow!r})")
        if self.transport not in ("ipc", "tcp"):
            problems.append(f"transport must be 'ipc' or 'tcp' (got {self.transport!r})")
        if not self.devices:
            problems.append("devices must name at least one device")
        if self.engine.max_batch < 1:
            problems.append(f"max_batch must be at least 1 (got {self.engine.max_batch})")
        for name in ("step_ms", "per_seq_ms", "prefill_ms_per_token", "jitter_ms", "first_step_ms"):
            if getattr(self.engine, name) < 0:
                problems.append(f"{name} must not be negative")
        if self.max_tokens_limit < 1 or self.max_prompt_tokens < 1:
            problems.append("max_tokens_limit and max_prompt_tokens must be at least 1")
        if problems:
            raise ValueError("; ".join(problems))


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
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library or no driver: no cards
        pass
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0
