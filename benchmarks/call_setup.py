"""How long grpc.aio takes to start N calls that a client opens at the same instant.

A floor under time to first token when streams start together (the closed loop of the
bring-your-own-model issue's 32-stream target, W1's 256): a bare grpc.aio server whose
handler answers one message holding the time it was entered, and a grpc.aio client that
opens N calls at once, ten times, both on the loop cadence runs on (uvloop when installed).
Reports client start -> handler entry and the full round trip, p50/p99, per N. No cadence
code on the path, unless `--accept-ahead N` adds cadence's call acceptor (N calls requested
from gRPC's core ahead of their arrival, as `cadence serve --accept-ahead` does).

    python benchmarks/call_setup.py [--calls 1 8 32 64 256] [--out results/call_setup.json]
    python benchmarks/call_setup.py --accept-ahead 64 --out results/call_setup_ahead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from pathlib import Path

import grpc
import msgspec

from cadence import event_loop
from cadence.lab.analysis.stats import distribution

METHOD = "/cadence.v1.Inference/Generate"


async def _serve(port: mp.Value, ready: mp.Event, accept_ahead: int) -> None:
    from cadence.net.call_acceptor import CallAcceptor

    async def entered(request: bytes, context) -> object:
        yield str(time.monotonic_ns()).encode()

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(entered)
    server.add_registered_method_handlers("cadence.v1.Inference", {"Generate": handler})
    port.value = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    CallAcceptor(server, {METHOD: handler}, (), accept_ahead).start()
    ready.set()
    await server.wait_for_termination()


def _server_main(port: mp.Value, ready: mp.Event, accept_ahead: int) -> None:
    event_loop.run(_serve(port, ready, accept_ahead))


async def _measure(target: str, calls: list[int], rounds: int) -> list[dict]:
    channel = grpc.aio.insecure_channel(target)
    await channel.channel_ready()
    generate = channel.unary_stream(METHOD)

    async def one() -> tuple[float, float]:
        start = time.monotonic_ns()
        async for message in generate(b""):
            return (int(message) - start) / 1e6, (time.monotonic_ns() - start) / 1e6
        raise RuntimeError("no message")

    rows = []
    for n in calls:
        for _ in range(3):  # warm-up rounds
            await asyncio.gather(*(one() for _ in range(n)))
        samples = []
        for _ in range(rounds):
            samples += await asyncio.gather(*(one() for _ in range(n)))
            await asyncio.sleep(0.05)
        entry = msgspec.structs.asdict(distribution([s[0] for s in samples]))
        trip = msgspec.structs.asdict(distribution([s[1] for s in samples]))
        rows.append({"calls_at_once": n, "to_handler_ms": entry, "round_trip_ms": trip})
        print(
            f"{n:4d} calls at once: client start -> handler p50 {entry['p50']:.2f} p99 "
            f"{entry['p99']:.2f} ms; round trip p50 {trip['p50']:.2f} p99 {trip['p99']:.2f} ms",
            flush=True,
        )
    await channel.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--accept-ahead",
        type=int,
        default=0,
        metavar="N",
        help="calls requested ahead by cadence's call acceptor (0: grpc.aio alone)",
    )
    parser.add_argument("--out", default="results/call_setup.json")
    args = parser.parse_args()
    spawn = mp.get_context("spawn")
    port, ready = spawn.Value("i", 0), spawn.Event()
    server = spawn.Process(target=_server_main, args=(port, ready, args.accept_ahead), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise SystemExit("the reference server did not start")
        rows = event_loop.run(_measure(f"127.0.0.1:{port.value}", args.calls, args.rounds))
    finally:
        server.kill()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"accept_ahead": args.accept_ahead, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
