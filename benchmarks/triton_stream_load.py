"""Closed-loop streaming load on a Triton decoupled model, recorded like cadence's load generator.

Runs in the PyTriton peer's virtual environment (it needs tritonclient, not cadence):

    /tmp/peers/pytriton311/bin/python benchmarks/triton_stream_load.py \\
        --streams 32 --requests 96 --tokens 50 --delay-ms 10 > records.json

One asyncio process (uvloop when installed), one gRPC channel, `--streams` bidirectional
`ModelStreamInfer` calls open at once, each sending its next request when the last one's
`--tokens` responses have arrived (the same closed loop as `cadence bench --concurrency`).
Prints one JSON object: {"records": [...], "cpu_s": ..., "wall_s": ...}; each record has
the fields of cadence.lab.records.RequestRecord that lab.stats.summarize reads, so both
servers' numbers come from the same definitions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
import tritonclient.grpc.aio as triton


def _inputs(tokens: int, delay_ms: int) -> list:
    n = triton.InferInput("N", [1], "INT32")
    n.set_data_from_numpy(np.array([tokens], dtype=np.int32))
    d = triton.InferInput("DELAY_MS", [1], "INT32")
    d.set_data_from_numpy(np.array([delay_ms], dtype=np.int32))
    return [n, d]


async def _lane(client, lane: int, todo, tokens: int, delay_ms: int, records: list) -> None:
    """One stream: send a request, read its `tokens` responses, repeat while work is left."""
    requests: asyncio.Queue = asyncio.Queue()

    async def send():
        while True:
            item = await requests.get()
            if item is None:
                return
            yield item

    responses = client.stream_infer(send())
    monotonic_ns = time.monotonic_ns
    for i in todo:
        record = {
            "request_id": f"bench-{i}",
            "process": 0,
            "max_tokens": tokens,
            "code": "OK",
            "error": "",
            "finish_reason": 0,
            "arrival_ns": [],
            "tokens": [],
            "index": [],
        }
        record["start_ns"] = monotonic_ns()
        requests.put_nowait(
            {"model_name": "tokens", "inputs": _inputs(tokens, delay_ms), "request_id": str(i)}
        )
        try:
            for _ in range(tokens):
                result, error = await responses.__anext__()
                record["arrival_ns"].append(monotonic_ns())
                if error is not None:
                    raise RuntimeError(str(error))
                value = int(result.as_numpy("TOKEN")[0])
                record["tokens"].append(1)
                record["index"].append(value)  # the model sends its position: checks order
            record["finish_reason"] = 1
        except Exception as exc:
            record["code"] = "CLIENT_ERROR"
            record["error"] = repr(exc)
        record["end_ns"] = monotonic_ns()
        records.append(record)
    requests.put_nowait(None)
    responses.cancel()


async def main(args: argparse.Namespace) -> dict:
    client = triton.InferenceServerClient(args.url)
    # Warm-up (not recorded): the model's first call pays one-off costs.
    warm: list = []
    await asyncio.gather(*(_lane(client, k, iter(range(1)), 2, 1, warm) for k in range(2)))
    counter = iter(range(args.requests))
    records: list = []
    cpu0, wall0 = time.process_time(), time.monotonic()
    await asyncio.gather(
        *(
            _lane(client, k, counter, args.tokens, args.delay_ms, records)
            for k in range(args.streams)
        )
    )
    cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - wall0
    await client.close()
    return {"records": records, "cpu_s": cpu_s, "wall_s": wall_s}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--delay-ms", type=int, default=10)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        out = asyncio.run(main(args))
    else:
        out = uvloop.run(main(args))
    print(json.dumps(out))
