"""`cadence serve --engine transformers` against `transformers serve` on the same tiny model,
both driven by `cadence bench --protocol openai` (/v1/completions, SSE), one after the other.

    python benchmarks/transformers_engine.py [--streams 16 64] [--requests-per-stream 4]
        [--max-tokens 64] [--open-s S] [--serving-deps DIR] [--out results/transformers_engine.json]

The model is examples/transformers_model.py's tiny random Qwen3 (2 layers, hidden 64), in
float32 on the CPU. cadence runs one worker (`--devices cpu:1`, all cores as its torch
threads) and one per core (`--devices cpu:2` here, one torch thread each). `transformers
serve` runs the model in its one process with its continuous batching
(`--continuous-batching`, paged attention), with torch's default threads (all cores) and
with one (OMP_NUM_THREADS=1); with `--plain` also without continuous batching (one generate
per request: slow, minutes at 64 streams). Closed loop: `streams` streams at once, each
sending `requests-per-stream` requests one after another, prompts of 16 characters (about 10
tokens), `max-tokens` tokens each, greedy (so both servers give the same tokens); with
`--open-s`, then an open loop (Poisson arrivals) at 70% of the best tokens/s the server
reached. Figures: benchmarks/bench_cell.py.

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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_cell import bench, free_port, wait_http

OPEN_LOAD = 0.7


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _cadence(folder: Path, workers: int) -> tuple[subprocess.Popen, str, str]:
    http = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "serve",
            "--engine",
            "transformers",
            "--model",
            str(folder),
            "--devices",
            f"cpu:{workers}",
            "--port",
            "0",
            "--http-port",
            str(http),
            "--served-model-name",
            "tiny",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{http}"
    wait_http(base + "/health", process)
    return process, base, "tiny"


def _hf(
    folder: Path, deps: str, continuous: bool, threads: int = 0
) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [deps, os.environ.get("PYTHONPATH")])),
    )
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    command = [
        str(Path(sys.executable).with_name("transformers")),
        "serve",
        str(folder),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--continuous-batching" if continuous else "--no-continuous-batching",
    ]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", process)
    return process, base, str(folder)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--serving-deps",
        default="",
        help="a folder with fastapi, uvicorn and accelerate for transformers serve",
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, 2],
        help="cadence runs: this many CPU workers, cores shared among them",
    )
    parser.add_argument(
        "--plain", action="store_true", help="also transformers serve without --continuous-batching"
    )
    parser.add_argument(
        "--open-s",
        type=float,
        default=0.0,
        help="then an open loop at 70%% of the best tokens/s, this many "
        "seconds' worth of requests (0: none)",
    )
    parser.add_argument("--out", default="results/transformers_engine.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from examples.transformers_model import build

    servers = [
        (f"cadence --engine transformers --devices cpu:{n}", lambda f, n=n: _cadence(f, n))
        for n in args.workers
    ]
    skipped = {}
    if args.serving_deps:
        servers.append(
            ("transformers serve --continuous-batching", lambda f: _hf(f, args.serving_deps, True))
        )
        servers.append(
            (
                "transformers serve --continuous-batching, OMP_NUM_THREADS=1",
                lambda f: _hf(f, args.serving_deps, True, threads=1),
            )
        )
        if args.plain:
            servers.append(("transformers serve", lambda f: _hf(f, args.serving_deps, False)))
    else:
        skipped["transformers serve"] = "needs fastapi, uvicorn and accelerate (--serving-deps DIR)"
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
                out = Path(tmp) / "bench.json"
                found = []
                for streams in args.streams:
                    found.append(
                        bench(
                            base,
                            "openai",
                            model,
                            out,
                            streams=streams,
                            requests=streams * args.requests_per_stream,
                            max_tokens=args.max_tokens,
                            prompt_tokens=16,
                        )
                    )
                best = max((r["tokens_per_s"] for r in found if r["requests_ok"]), default=0)
                if args.open_s and best:  # Poisson arrivals at 70% of its best tokens/s
                    rate = OPEN_LOAD * best / args.max_tokens
                    found.append(
                        bench(
                            base,
                            "openai",
                            model,
                            out,
                            rate=rate,
                            requests=max(10, int(rate * args.open_s)),
                            max_tokens=args.max_tokens,
                            prompt_tokens=16,
                        )
                    )
                for row in found:
                    row["server"] = name
                    print(json.dumps(row), flush=True)
                rows.extend(found)
            finally:
                _stop(process)
    Path(args.out).write_text(
        json.dumps(
            {
                "command": "python " + " ".join(sys.argv),
                "model": "examples/transformers_model.py (Qwen3, 2 layers, hidden 64, float32, CPU)",
                "max_tokens": args.max_tokens,
                "prompt_tokens": 16,
                "open_s": args.open_s,
                "requests_per_stream": args.requests_per_stream,
                "date": time.strftime("%Y-%m-%d"),
                "transformers": _version("transformers"),
                "torch": _version("torch"),
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "rows": rows,
                "skipped": skipped,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
