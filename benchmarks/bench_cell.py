"""One cell of a side-by-side table: `cadence bench` against one running server, closed loop
(`streams` at once) or open loop (`rate` requests/s), the figures the tables compare, and
`stop_group` for the servers a benchmark starts.

Used by benchmarks/batched_side_by_side.py, transformers_engine.py, false_alarms.py and
peers.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until `url` answers 200; RuntimeError if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before answering {url}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.2)


def stop_group(process: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
    """Send `sig` to the process group `process` leads (started with start_new_session), then
    SIGKILL if the leader has not exited after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def bench(
    target: str,
    protocol: str,
    model: str,
    out: Path,
    *,
    streams: int = 0,
    rate: float = 0.0,
    requests: int,
    max_tokens: int,
    prompt_tokens: int = 8,
    server_pid: int | None = None,
    extra: tuple[str, ...] = (),
) -> dict:
    """Run `cadence bench` once; the row of figures (see `row`). Without `server_pid` the
    bench samples cadence's own processes, or the process listening on the target's port."""
    command = [
        sys.executable,
        "-m",
        "cadence.cli",
        "bench",
        "--target",
        target,
        "--protocol",
        protocol,
        "--model",
        model,
        *extra,
    ]
    command += ["--concurrency", str(streams)] if streams else ["--rate", f"{rate:.2f}"]
    command += [
        "--requests",
        str(requests),
        "--max-tokens",
        str(max_tokens),
        "--prompt-tokens",
        str(prompt_tokens),
        "--warmup",
        "2",
        "--no-timing",
        "--no-progress",
        "--json",
        str(out),
    ]
    if server_pid is not None:
        command += ["--server-pid", str(server_pid)]
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL, timeout=900)
    result = row(json.loads(out.read_text()))
    result.update(
        loop="closed" if streams else "open",
        streams=streams or None,
        rate_per_s=round(rate, 2) if rate else None,
        command="cadence " + " ".join(command[4:-2]),
    )
    return result


def row(stats: dict) -> dict:
    """tokens/s, TTFT and ITL percentiles, and the server's CPU per output token: its front
    process (the one that serves the port) and all its sampled processes together."""
    tokens = stats["output_tokens"] or 1
    wall = stats["wall_s"]
    processes = {
        name: p["cpu_pct_mean"]
        for name, p in stats["system"]["processes"].items()
        if not name.startswith("client") and p.get("cpu_pct_mean") is not None
    }
    # cadence's front process, or the process that listens on a peer's port.
    front = processes.get("front", processes.get("server"))
    client = stats.get("client", {})
    return {
        "requests": stats["requests"],
        "requests_ok": stats["requests_ok"],
        "output_tokens": stats["output_tokens"],
        "wall_s": round(wall, 2),
        "tokens_per_s": round(stats["tokens_per_s"], 1),
        "ttft_p50_ms": _q(stats["ttft_ms"], "p50"),
        "ttft_p99_ms": _q(stats["ttft_ms"], "p99"),
        "itl_p50_ms": _q(stats["itl_ms"], "p50"),
        "itl_p99_ms": _q(stats["itl_ms"], "p99"),
        "chunk_gap_p99_ms": _q(stats["chunk_gap_ms"], "p99"),
        "front_cpu_us_per_token": (
            round(front / 100 * wall * 1e6 / tokens, 1) if front is not None else None
        ),
        "server_cpu_us_per_token": round(sum(processes.values()) / 100 * wall * 1e6 / tokens, 1),
        "server_cpu_pct": processes,
        "client_behind_schedule": client.get("behind_schedule"),
        "errors_by_code": stats["errors_by_code"],
        "integrity": stats.get("integrity"),
    }


def _q(distribution: dict, name: str) -> float | None:
    value = distribution.get(name)
    return None if value is None else round(value, 2)
