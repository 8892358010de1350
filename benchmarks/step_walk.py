"""Micro-benchmark: the front's walk of one packed StepOutput (OutputReader._push_step) and the
worker's split of it per front (split_step, `--fronts N`), in ns per sequence-step.

    flock /tmp/cadence-bench.lock python benchmarks/step_walk.py [--batch 256] [--repeat 15]

A step of `--batch` sequences, one token each (a batching engine's fast path), pushed into
that many live streams; the pieces layout (token_counts, two tokens each) and the split are
timed too. Streams are emptied before each repeat so their buffers stay short.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit

from cadence.byte_tokenizer import ByteTokenizer
from cadence.core.metrics import FrontMetrics, StreamTally
from cadence.core.output_reader import OutputReader
from cadence.core.stream import RequestStream
from cadence.transport.messages import StepOutput
from cadence.transport.worker_to_fronts import split_step


def _streams(batch: int) -> dict[int, RequestStream]:
    tally, tokenizer = StreamTally(), ByteTokenizer()
    return {
        seq_id: RequestStream(
            seq_id,
            0,
            8,
            capacity=1 << 30,
            overflow="merge",
            include_timing=False,
            decoder=tokenizer.stream_decoder(),
            received_ns=0,
            tally=tally,
        )
        for seq_id in range(batch)
    }


def _time(fn, reset, number: int, repeat: int, per: int) -> dict[str, float]:
    runs = []
    for _ in range(repeat):
        reset()
        runs.append(
            timeit.Timer(fn, timer=time.process_time).timeit(number=number) / (number * per) * 1e9
        )
    return {"min_ns": round(min(runs), 1), "median_ns": round(statistics.median(runs), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    batch = args.batch
    streams = _streams(batch)
    reader = OutputReader(streams, lambda message: None, FrontMetrics(), 1)

    def reset() -> None:
        for stream in streams.values():
            stream._tokens = []
            stream._steps = 0

    ids = list(range(batch))
    single = StepOutput(0, 1, 10, 20, ids, [65 + i % 26 for i in ids], [], [])
    pieces = StepOutput(
        0,
        1,
        10,
        20,
        ids,
        [65 + i % 26 for i in ids for _ in range(2)],
        [],
        [],
        token_counts=[2] * batch,
    )
    result = {
        "batch": batch,
        "push_one_token": _time(
            lambda: reader._push_step(single, 30), reset, args.number, args.repeat, batch
        ),
        "push_pieces": _time(
            lambda: reader._push_step(pieces, 30), reset, args.number, args.repeat, batch
        ),
        "split_2_fronts": _time(
            lambda: split_step(single, 2), lambda: None, args.number, args.repeat, batch
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
