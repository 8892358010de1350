"""cadence and PyTriton side by side, driven by the same client: `cadence bench --protocol kserve`.

    python benchmarks/peers.py [--streams 1 32 256] [--tokens 50] [--rounds 2]
        [--skip-pytriton] [--out results/peers.json]

The token workload, the same on both servers: each request makes N tokens (N = --tokens),
one every 10 ms (`await asyncio.sleep` on both sides), so the ideal is a first token at 10
ms, a gap of 10 ms and 100 tokens/s per stream.

- cadence: `cadence serve --app examples.token_app:async_tokens --devices cpu:1`, its model
  `cadence` over the Open Inference Protocol (inputs PROMPT_TOKEN_IDS, MAX_TOKENS).
- PyTriton 0.7 (a Triton 2.51 server inside the wheel), decoupled model `tokens` in
  `--mode async`, started by ../shared/peers/start_pytriton.sh (PEERS_DIR, default
  /tmp/peers, from ../shared/peers/setup.sh); inputs N = max_tokens, DELAY_MS = 10.

Both are driven by the same command, one client process (uvloop), closed loop,
`streams` streams open at once, `rounds` x `streams` requests after 2 warm-up requests:

    cadence bench --target HOST:PORT --protocol kserve --model NAME [--kserve-inputs ...] \\
        --concurrency S --requests S*R --max-tokens N --prompt-tokens 8 --warmup 2 --json F

The table gives each server's TTFT, ITL and tokens/s, and the ratio cadence ÷ PyTriton
(below 1 for a latency: cadence is faster; above 1 for tokens/s: cadence delivers more).
Without the PyTriton venv, only cadence runs and the output says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from cadence.lab.servers.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_cell import free_port, stop_group, wait_http

PEERS_SCRIPTS = ROOT.parent / "shared" / "peers"
DELAY_MS = 10
WARMUP = 2
METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"))


def bench(
    target: str,
    model: str,
    streams: int,
    tokens: int,
    rounds: int,
    kserve_inputs: str | None = None,
) -> dict:
    """Run `cadence bench --protocol kserve` against `target`; the numbers this table compares."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        command = ["cadence", "bench", "--target", target, "--protocol", "kserve", "--model", model]
        if kserve_inputs:
            command += ["--kserve-inputs", kserve_inputs]
        command += [
            "--concurrency",
            str(streams),
            "--requests",
            str(streams * rounds),
            "--max-tokens",
            str(tokens),
            "--prompt-tokens",
            "8",
            "--warmup",
            str(WARMUP),
            "--json",
            str(out),
        ]
        subprocess.run(
            [sys.executable, "-m", "cadence.cli", *command[1:]],
            check=True,
            capture_output=True,
            text=True,
            timeout=900,
        )
        result = json.loads(out.read_text())
    row = {f"{name}_{q}": result[name][q] for name, q in METRICS}
    row.update(
        tokens_per_s=result["tokens_per_s"],
        requests_ok=result["requests_ok"],
        requests=result["requests"],
        errors=result["errors_by_code"],
        integrity=result["integrity"],
        client_cpu_share=result["client"]["busiest_process_cpu_share"],
        server_cpu_pct={
            name: p["cpu_pct_mean"]
            for name, p in result["system"].get("processes", {}).items()
            if not name.startswith("client")
        },
        command=" ".join(command[:-2]),
    )
    return row


def run_cadence(streams: int, tokens: int, rounds: int) -> dict:
    # The worker imports examples.token_app from the repository root.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    args = (
        "--app",
        "examples.token_app:async_tokens",
        "--devices",
        "cpu:1",
        "--max-concurrent",
        str(max(1024, streams)),
    )
    with ServerProcess(*args) as server:
        row = bench(server.target, "cadence", streams, tokens, rounds)
    row["server"] = "cadence serve " + " ".join(args)
    return row


@contextlib.contextmanager
def pytriton_server(peers: Path):
    """Start the shared peers' PyTriton token server (decoupled, async); yield its gRPC target."""
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    server = subprocess.Popen(
        [
            "bash",
            str(PEERS_SCRIPTS / "start_pytriton.sh"),
            "--mode",
            "async",
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--metrics-port",
            str(metrics_port),
        ],
        env={**os.environ, "PEERS_DIR": str(peers)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{http_port}/v2/models/tokens/ready", server, 90.0)
        yield f"127.0.0.1:{grpc_port}"
    finally:
        # The script's process group is ours alone: SIGINT stops PyTriton and its Triton.
        stop_group(server, signal.SIGINT)


def run_pytriton(streams: int, tokens: int, rounds: int, peers: Path) -> dict:
    with pytriton_server(peers) as target:
        row = bench(
            target,
            "tokens",
            streams,
            tokens,
            rounds,
            kserve_inputs=f"N=max_tokens,DELAY_MS={DELAY_MS}",
        )
    row["server"] = "start_pytriton.sh --mode async (PyTriton 0.7, Triton 2.51)"
    return row


def table(rows: list[dict]) -> str:
    """One line per stream count and metric: cadence, PyTriton, and their ratio."""
    lines = [
        f"{'streams':>7}  {'metric':<14} {'cadence':>9} {'PyTriton':>9} {'cadence/PyTriton':>17}"
    ]
    by_streams: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_streams.setdefault(row["streams"], {})[row["peer"]] = row
    for streams, peers in sorted(by_streams.items()):
        for key in [f"{n}_{q}" for n, q in METRICS] + ["tokens_per_s"]:
            ours, theirs = peers.get("cadence", {}).get(key), peers.get("pytriton", {}).get(key)
            ratio = f"{ours / theirs:.2f}" if ours is not None and theirs else "-"
            lines.append(f"{streams:>7}  {key:<14} {_fmt(ours):>9} {_fmt(theirs):>9} {ratio:>17}")
        ok = "  ".join(
            f"{name} {p['requests_ok']}/{p['requests']} ok, client CPU {p['client_cpu_share']:.0%}"
            for name, p in peers.items()
        )
        lines.append(f"{'':>7}  {ok}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream")
    parser.add_argument("--skip-pytriton", action="store_true")
    parser.add_argument("--peers", default=os.environ.get("PEERS_DIR", "/tmp/peers"))
    parser.add_argument("--out", default="results/peers.json")
    args = parser.parse_args()
    peers = Path(args.peers)
    have_pytriton = (
        not args.skip_pytriton
        and (peers / "pytriton311" / "bin" / "python").exists()
        and (PEERS_SCRIPTS / "start_pytriton.sh").exists()
    )
    rows = []
    for streams in args.streams:
        runs = [("cadence", run_cadence, (streams, args.tokens, args.rounds))]
        if have_pytriton:
            runs.append(("pytriton", run_pytriton, (streams, args.tokens, args.rounds, peers)))
        for name, run, run_args in runs:
            print(f"{name}, {streams} streams ...", file=sys.stderr, flush=True)
            rows.append({"peer": name, "streams": streams, **run(*run_args)})
    print(table(rows))
    if not have_pytriton:
        print(f"PyTriton not measured: no {peers}/pytriton311 (run ../shared/peers/setup.sh)")
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "tokens": args.tokens,
        "delay_ms": DELAY_MS,
        "rounds": args.rounds,
        "warmup": WARMUP,
        "pytriton": have_pytriton,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
