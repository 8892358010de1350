"""The lab's own error on a service it did not write: `cadence bench --protocol grpc` against a
known service, beside a minimal reference client, in one run.

The service is the Node.js @grpc/grpc-js ticker of the tests (tests/node; `npm ci --prefix
tests/node` first): each Count call sends its first message `--first-delay-ms` after the call
reaches its handler, then one every `--gap-ms` on an absolute schedule. The planted values are
the yardstick; what a client sees on top of them is the call's set-up and delivery (server and
client), which any client pays. So the same streams are also measured by the smallest client
that can measure them: one grpc.aio process, N tasks each opening its calls in a loop, a
timestamp before the call and at each message, nothing else. The lab's own error is what it
reports beyond that reference; the target (a benchmark, not a test) is TTFT and gap p50 within
0.5 ms of the planted values at 64 streams.

    python benchmarks/grpc_lab_error.py [--streams 1 64] [--rounds 3] [--pairs 2]
        [--out results/grpc_lab_error.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import grpc
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec

from cadence import event_loop
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.grpc_schema import from_reflection, message_classes
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.plan import RequestShape
from tests.node_ticker import COUNT_METHOD, ticker_server

TARGET_MS = 0.5


def _reference(
    target: str,
    schema_bytes: bytes,
    streams: int,
    rounds: int,
    messages: int,
    delay_ms: int,
    gap_ms: int,
    out,
) -> None:
    """The minimal client, in a process of its own: TTFT and gaps of every call."""
    import msgspec

    from cadence.lab.load.grpc_schema import MethodSchema

    schema = msgspec.msgpack.decode(schema_bytes, type=MethodSchema)
    request_type, _ = message_classes(schema)
    request = request_type(
        count=messages, first_delay_ms=delay_ms, gap_ms=gap_ms
    ).SerializeToString()

    async def main() -> tuple[list[float], list[float]]:
        channel = grpc.aio.insecure_channel(target)
        await channel.channel_ready()
        method = channel.unary_stream(schema.path)
        ttft: list[float] = []
        gaps: list[float] = []

        async def lane(warm: bool) -> None:
            for _ in range(1 if warm else rounds):
                start = time.monotonic_ns()
                arrivals = []
                async for _ in method(request):
                    arrivals.append(time.monotonic_ns())
                if warm:
                    continue
                ttft.append((arrivals[0] - start) / 1e6)
                gaps.extend((b - a) / 1e6 for a, b in zip(arrivals, arrivals[1:], strict=False))

        await asyncio.gather(*(lane(True) for _ in range(min(streams, 4))))
        await asyncio.gather(*(lane(False) for _ in range(streams)))
        await channel.close()
        return ttft, gaps

    ttft, gaps = event_loop.run(main())
    out.send((statistics.median(ttft), statistics.median(gaps), len(ttft)))


def reference(target: str, schema, *args) -> tuple[float, float, int]:
    import msgspec

    context = mp.get_context("spawn")
    here, there = context.Pipe()
    proc = context.Process(
        target=_reference, args=(target, msgspec.msgpack.encode(schema), *args, there)
    )
    proc.start()
    result = here.recv()
    proc.join()
    return result


def lab(
    target: str, grpc_target: GrpcTarget, streams: int, rounds: int, messages: int
) -> tuple[float, float, int]:
    workload = Workload(
        requests=streams * rounds,
        concurrency=streams,
        warmup=min(streams, 4),
        shape=RequestShape(max_tokens=(messages, messages)),
    )
    result = msgspec.to_builtins(run_bench(target, workload, protocol=grpc_target))
    assert result["requests_ok"] == streams * rounds, result["errors_by_code"]
    return result["ttft_ms"]["p50"], result["chunk_gap_ms"]["p50"], result["requests_ok"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=3, help="calls per stream")
    parser.add_argument(
        "--pairs", type=int, default=2, help="runs of each client, alternating ABBA (default 2)"
    )
    parser.add_argument("--messages", type=int, default=50)
    parser.add_argument("--first-delay-ms", type=int, default=50)
    parser.add_argument("--gap-ms", type=int, default=20)
    parser.add_argument("--out", default="results/grpc_lab_error.json")
    args = parser.parse_args()
    request = json.dumps(
        {"count": "{max_tokens}", "first_delay_ms": args.first_delay_ms, "gap_ms": args.gap_ms}
    )
    rows = []
    with ticker_server() as target:
        with grpc.insecure_channel(target) as channel:
            schema = from_reflection(channel, COUNT_METHOD)
        grpc_target = GrpcTarget(schema=schema, request_json=request, index_field="seq")
        for streams in args.streams:
            # ABBA, --pairs times: neither client always runs on a warmer or busier machine;
            # each one's p50s are the medians over its runs.
            refs, labs = [], []
            for k in range(2 * args.pairs):
                if k % 4 in (0, 3):
                    refs.append(
                        reference(
                            target,
                            schema,
                            streams,
                            args.rounds,
                            args.messages,
                            args.first_delay_ms,
                            args.gap_ms,
                        )
                    )
                else:
                    labs.append(lab(target, grpc_target, streams, args.rounds, args.messages))
            ref = [statistics.median(r[n] for r in refs) for n in (0, 1)] + [refs[0][2]]
            got = [statistics.median(r[n] for r in labs) for n in (0, 1)] + [labs[0][2]]
            row = {
                "streams": streams,
                "lab_ttft_p50_ms": round(got[0], 3),
                "lab_gap_p50_ms": round(got[1], 3),
                "reference_ttft_p50_ms": round(ref[0], 3),
                "reference_gap_p50_ms": round(ref[1], 3),
                "lab_ttft_over_planted_ms": round(got[0] - args.first_delay_ms, 3),
                "lab_gap_over_planted_ms": round(got[1] - args.gap_ms, 3),
                "lab_ttft_over_reference_ms": round(got[0] - ref[0], 3),
                "lab_gap_over_reference_ms": round(got[1] - ref[1], 3),
                "calls_per_run": got[2],
                "runs_each": args.pairs,
                "lab_ttft_p50_runs_ms": [round(r[0], 3) for r in labs],
                "reference_ttft_p50_runs_ms": [round(r[0], 3) for r in refs],
            }
            rows.append(row)
            print(
                f"{streams:3} streams: TTFT p50 lab {got[0]:.2f} ms, reference {ref[0]:.2f} ms "
                f"(planted {args.first_delay_ms}); gap p50 lab {got[1]:.3f} ms, reference "
                f"{ref[1]:.3f} ms (planted {args.gap_ms})",
                flush=True,
            )
    top = max(rows, key=lambda r: r["streams"])
    result = {
        "machine": {"cpus": psutil.cpu_count(), "load_before": psutil.getloadavg()},
        "service": "tests/node/ticker_server.js (Node.js, @grpc/grpc-js), reflection on",
        "planted": {
            "first_delay_ms": args.first_delay_ms,
            "gap_ms": args.gap_ms,
            "messages": args.messages,
        },
        "target_ms": TARGET_MS,
        "met_against_planted": (
            abs(top["lab_ttft_over_planted_ms"]) <= TARGET_MS
            and abs(top["lab_gap_over_planted_ms"]) <= TARGET_MS
        ),
        "met_against_reference": (
            abs(top["lab_ttft_over_reference_ms"]) <= TARGET_MS
            and abs(top["lab_gap_over_reference_ms"]) <= TARGET_MS
        ),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"within {TARGET_MS} ms at {top['streams']} streams: of the planted values "
        f"{result['met_against_planted']}, of the reference client "
        f"{result['met_against_reference']}; {args.out}"
    )


if __name__ == "__main__":
    main()
