"""The simplest possible server for the same contract: a grpc.aio handler that makes its own
tokens, one per `--step-ms`, with no engine, no workers and no IPC.

A reference for the serving-overhead benchmark: whatever latency it adds over the step is the
cost of grpc.aio and the client on this machine, not of cadence.

    python benchmarks/plain_grpc_reference.py --port 0 --step-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc

from cadence.api.v1 import inference_pb2 as pb
from cadence.api.v1 import inference_pb2_grpc as pb_grpc


class PlainInference(pb_grpc.InferenceServicer):
    def __init__(self, step_s: float) -> None:
        self._step_s = step_s

    async def Generate(self, request, context):
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        for i in range(request.max_tokens):
            next_at += self._step_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            yield pb.GenerateChunk(
                request_id=request.request_id, index=i, token_ids=[65], text="A",
                finish_reason=pb.FINISH_REASON_LENGTH if i == request.max_tokens - 1 else 0,
            )


async def main(port: int, step_ms: float) -> None:
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(PlainInference(step_ms / 1e3), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"cadence serving on 127.0.0.1:{bound}", flush=True)  # the banner ServerProcess reads
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    asyncio.run(main(args.port, args.step_ms))
