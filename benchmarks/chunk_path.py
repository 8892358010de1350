"""Micro-benchmark: the front's Python per chunk of a timed cadence.v1 stream, in ns (CPU time).

    flock /tmp/cadence-bench.lock python benchmarks/chunk_path.py [--chunks 10000] [--repeat 7]

One stream with its output always waiting (no event-loop wake-up is timed): push one token
(with its step's times and CPU wait) as the output reader does, take the chunk through `Generation.__anext__` (the core) and
`to_chunk` plus serialization (the v1 adapter). What grpc.aio and the kernel then do per
chunk is the same for any Python server and is not in this figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from cadence.api.v1.service import to_chunk
from cadence.config import ServerConfig
from cadence.core.generation import FrontCore
from cadence.core.metrics import FrontMetrics
from cadence.core.requests import Request
from cadence.router import WorkerRouter


class _Link:
    """A worker link that sends nothing."""

    def add(self, frame: object) -> None:
        pass

    def abort(self, seq_id: int) -> None:
        pass


async def _run(chunks: int, repeat: int, piece: object) -> list[float]:
    core = FrontCore(ServerConfig(), [_Link()], WorkerRouter(1), FrontMetrics())
    core.refusal = None
    runs = []
    for k in range(repeat):
        generation = core.open(
            Request(request_id=f"r{k}", prompt="hi", max_tokens=chunks + 1, include_timing=True),
            time.monotonic_ns(),
            lambda: None,
            protocol="cadence.v1",
        )
        stream = generation.stream
        started = time.process_time()
        for _ in range(chunks):
            stream.push(piece, None, 1, 2, 3, 4)
            to_chunk(await generation.__anext__(), "r").SerializeToString()
        runs.append((time.process_time() - started) / chunks * 1e9)
        generation.close()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument(
        "--list-piece",
        action="store_true",
        help="push [token] instead of a bare token (how main's reader pushed)",
    )
    args = parser.parse_args()
    runs = asyncio.run(_run(args.chunks, args.repeat, [65] if args.list_piece else 65))
    print(
        json.dumps(
            {
                "ns_per_chunk_min": round(min(runs)),
                "ns_per_chunk_median": round(sorted(runs)[len(runs) // 2]),
            }
        )
    )


if __name__ == "__main__":
    main()
