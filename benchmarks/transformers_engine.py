"""`cadence serve --engine transformers` against `transformers serve` on the same tiny model,
both driven by `cadence bench --protocol openai` (/v1/completions, SSE), one after the other.

    python benchmarks/transformers_engine.py [--streams 16 64] [--requests-per-stream 4]
        [--max-tokens 64] [--serving-deps DIR] [--out results/transformers_engine.json]

The model is examples/transformers_model.py's tiny random Qwen3 (2 layers, hidden 64), in
float32 on the CPU. cadence runs one worker (`--devices cpu:1`, all cores as its torch
threads) and one per core (`--devices cpu:2` here, one torch thread each). `transformers
serve` runs the model in its one process with its continuous batching
(`--continuous-batching`, paged attention), with torch's default threads (all cores) and
with one (OMP_NUM_THREADS=1); with `--plain` also without continuous batching (one generate
per request: slow, minutes at 64 streams). Closed loop: `streams` streams at once, each
sending `requests-per-stream` requests one after another, prompts of 16 characters (about 10
tokens), `max-tokens` tokens each, greedy (so both servers give the same tokens).

`transformers serve` needs FastAPI, Uvicorn and accelerate, which the project's environment
does not install (transformers' `serving` extra); point `--serving-deps` at a folder holding
them (`pip install --target DIR fastapi uvicorn && pip install --no-deps --target DIR
accelerate`); without it that peer is skipped, and the result says why.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
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


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _bench(base: str, model: str, streams: int, requests: int, max_tokens: int,
           pid: int, out: Path) -> dict:
    command = [sys.executable, "-m", "cadence.cli", "bench", "--protocol", "openai",
               "--target", base, "--model", model, "--concurrency", str(streams),
               "--requests", str(streams * requests), "--max-tokens", str(max_tokens),
               "--prompt-tokens", "16", "--warmup", "2", "--server-pid", str(pid),
               "--no-timing", "--no-progress", "--json", str(out)]
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
    stats = json.loads(out.read_text())  # a BenchResult: the run's stats at the top
    return {"streams": streams, "requests": stats["requests"],
            "requests_ok": stats["requests_ok"], "output_tokens": stats["output_tokens"],
            "tokens_per_s": round(stats["tokens_per_s"], 1),
            "ttft_p50_ms": round(stats["ttft_ms"]["p50"], 1),
            "ttft_p99_ms": round(stats["ttft_ms"]["p99"], 1),
            "itl_p99_ms": round(stats["itl_ms"]["p99"], 1),
            "errors_by_code": stats["errors_by_code"]}


def _cadence(folder: Path, workers: int) -> tuple[subprocess.Popen, str, str]:
    http = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "serve", "--engine", "transformers", "--model",
         str(folder), "--devices", f"cpu:{workers}", "--port", "0", "--http-port", str(http),
         "--served-model-name", "tiny", "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{http}"
    _wait_http(base + "/health", process)
    return process, base, "tiny"


def _hf(folder: Path, deps: str, continuous: bool,
        threads: int = 0) -> tuple[subprocess.Popen, str, str]:
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [deps, os.environ.get("PYTHONPATH")])))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    command = [str(Path(sys.executable).with_name("transformers")), "serve", str(folder),
               "--port", str(port), "--device", "cpu", "--dtype", "float32",
               "--continuous-batching" if continuous else "--no-continuous-batching"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    _wait_http(base + "/health", process)
    return process, base, str(folder)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--serving-deps", default="",
                        help="a folder with fastapi, uvicorn and accelerate for transformers serve")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="cadence runs: this many CPU workers, cores shared among them")
    parser.add_argument("--plain", action="store_true",
                        help="also transformers serve without --continuous-batching")
    parser.add_argument("--out", default="results/transformers_engine.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from examples.transformers_model import build

    servers = [(f"cadence --engine transformers --devices cpu:{n}",
                lambda f, n=n: _cadence(f, n)) for n in args.workers]
    skipped = {}
    if args.serving_deps:
        servers.append(("transformers serve --continuous-batching",
                        lambda f: _hf(f, args.serving_deps, True)))
        servers.append(("transformers serve --continuous-batching, OMP_NUM_THREADS=1",
                        lambda f: _hf(f, args.serving_deps, True, threads=1)))
        if args.plain:
            servers.append(("transformers serve", lambda f: _hf(f, args.serving_deps, False)))
    else:
        skipped["transformers serve"] = ("needs fastapi, uvicorn and accelerate "
                                         "(--serving-deps DIR)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "tiny-qwen3")
        for name, start in servers:
            try:
                process, base, model = start(folder)
            except RuntimeError as exc:
                skipped[name] = str(exc)
                continue
            try:
                for streams in args.streams:
                    row = {"server": name, **_bench(base, model, streams,
                                                    args.requests_per_stream, args.max_tokens,
                                                    process.pid, Path(tmp) / "bench.json")}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            finally:
                _stop(process)
    Path(args.out).write_text(json.dumps({
        "command": "python " + " ".join(sys.argv),
        "model": "examples/transformers_model.py (Qwen3, 2 layers, hidden 64, float32, CPU)",
        "max_tokens": args.max_tokens, "prompt_tokens": 16,
        "requests_per_stream": args.requests_per_stream, "date": time.strftime("%Y-%m-%d"),
        "transformers": _version("transformers"), "torch": _version("torch"),
        "host": platform.node(),
        "cpus": os.cpu_count(), "load_average": os.getloadavg(), "rows": rows,
        "skipped": skipped,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
