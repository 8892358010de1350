"""benchmarks/batched_step.py's step function served by each peer with its own batching and
streaming, one per process, each run by the python of the peer's own venv:

    python benchmarks/batched_peers.py litserve --port P --max-batch B
    python benchmarks/batched_peers.py rayserve --port P --max-batch B
    python benchmarks/batched_peers.py pytriton --port P --http-port H --metrics-port M --max-batch B

- LitServe: a `LitAPI` with `max_batch_size`, `batch_timeout` and `stream=True` behind its
  `OpenAISpec` (/v1/chat/completions, SSE): `predict` gets the gathered batch and yields one
  piece per request per step until the batch is done.
- Ray Serve: one replica, `@serve.batch` on an async generator (yields one list of pieces per
  step, `StopIteration` for a finished request; the step runs in the default executor so
  that the replica's event loop stays free to stream), behind a FastAPI ingress that answers
  /v1/completions with OpenAI's SSE; Serve's HTTP proxy on 127.0.0.1.
- PyTriton: `@batch` on a generator, decoupled, Triton's dynamic batcher; input N
  (max_tokens, batch dimension first: `cadence bench --kserve-inputs N=max_tokens:batched`),
  output TOKEN (int32[1]), one response per step per request; gRPC on 127.0.0.1.

(No `from __future__ import annotations` here: FastAPI reads the handler's annotations.)

Every peer gathers a batch for up to BATCH_WAIT_S (as cadence's --batch-timeout-ms does for
the generator shape) and runs it to its end: requests that arrive meanwhile wait for the next
batch. Each prints READY once it serves.
"""

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from batched_step import FIRST, StepFunction, first_letter

BATCH_WAIT_S = 0.01


try:  # LitServe's workers are spawned processes: its API class must be importable by name
    import litserve as ls
except ImportError:  # another peer's venv
    ls = None
else:

    class BatchedAPI(ls.LitAPI):
        def setup(self, device: str) -> None:
            self.fn = StepFunction()

        def decode_request(self, request):
            return first_letter(request.messages[-1].content), request.max_tokens or 16

        def batch(self, inputs):
            return list(inputs)

        def predict(self, inputs):
            last = [letter for letter, _ in inputs]
            counts = [n for _, n in inputs]
            for step in range(max(counts)):
                tokens = self.fn.step(last)
                last = [t - FIRST for t in tokens]
                # A request with fewer tokens gets empty pieces until the batch ends.
                yield [chr(t) if step < n else "" for t, n in zip(tokens, counts)]

        def unbatch(self, output):
            yield from output

        def encode_response(self, outputs):
            for pieces in outputs:
                yield [{"role": "assistant", "content": piece} for piece in pieces]


def litserve(port: int, max_batch: int) -> None:
    api = BatchedAPI(
        max_batch_size=max_batch, batch_timeout=BATCH_WAIT_S, stream=True, spec=ls.OpenAISpec()
    )
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=600)
    print("READY", flush=True)
    server.run(host="127.0.0.1", port=port, generate_client_file=False, log_level="warning")


def rayserve(port: int, max_batch: int) -> None:
    import ray
    from fastapi import FastAPI, Request
    from ray import serve
    from starlette.responses import StreamingResponse

    app = FastAPI()

    @serve.deployment(max_ongoing_requests=4096)
    @serve.ingress(app)
    class Batched:
        def __init__(self) -> None:
            self.fn = StepFunction()

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=BATCH_WAIT_S)
        async def steps(self, requests: list[tuple[int, int]]):
            last = [letter for letter, _ in requests]
            counts = [n for _, n in requests]
            loop = asyncio.get_running_loop()
            for step in range(max(counts)):
                # Off the replica's event loop, which must stay free to send the pieces
                # (computing on it held every stream's pieces back to the end).
                tokens = await loop.run_in_executor(None, self.fn.step, last)
                last = [t - FIRST for t in tokens]
                yield [chr(t) if step < n else StopIteration for t, n in zip(tokens, counts)]

        @app.post("/v1/completions")
        async def completions(self, request: Request) -> StreamingResponse:
            body = await request.json()
            count = int(body.get("max_tokens") or 16)
            pieces = self.steps((first_letter(body.get("prompt") or ""), count))

            async def events():
                sent = 0
                async for piece in pieces:
                    sent += 1
                    done = "length" if sent == count else None
                    yield (
                        "data: "
                        + json.dumps(
                            {
                                "object": "text_completion",
                                "choices": [{"index": 0, "text": piece, "finish_reason": done}],
                            }
                        )
                        + "\n\n"
                    )
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "object": "text_completion",
                            "choices": [],
                            "usage": {
                                "prompt_tokens": 0,
                                "completion_tokens": sent,
                                "total_tokens": sent,
                            },
                        }
                    )
                    + "\n\n"
                )
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Batched.bind(), route_prefix="/")
    print("READY", flush=True)
    while True:
        time.sleep(3600)


def pytriton(port: int, http_port: int, metrics_port: int, max_batch: int) -> None:
    import numpy as np
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    fn = StepFunction()

    @batch
    def infer(N):
        counts = N.reshape(-1).tolist()
        last = [0] * len(counts)
        for _ in range(max(counts)):
            tokens = fn.step(last)
            last = [t - FIRST for t in tokens]
            yield {"TOKEN": np.array(tokens, dtype=np.int32).reshape(-1, 1)}

    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=http_port,
        grpc_address="127.0.0.1",
        grpc_port=port,
        metrics_address="127.0.0.1",
        metrics_port=metrics_port,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name="batched",
            infer_func=infer,
            inputs=[Tensor(name="N", dtype=np.int32, shape=(1,))],
            outputs=[Tensor(name="TOKEN", dtype=np.int32, shape=(1,))],
            config=ModelConfig(
                max_batch_size=max_batch,
                decoupled=True,
                batcher=DynamicBatcher(max_queue_delay_microseconds=int(BATCH_WAIT_S * 1e6)),
            ),
            strict=True,
        )
        print("READY", flush=True)
        triton.serve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=["litserve", "rayserve", "pytriton"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http-port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=256)
    args = parser.parse_args()
    if args.peer == "litserve":
        litserve(args.port, args.max_batch)
    elif args.peer == "rayserve":
        rayserve(args.port, args.max_batch)
    else:
        pytriton(args.port, args.http_port, args.metrics_port, args.max_batch)


if __name__ == "__main__":
    main()
