"""The simplest possible server for the same contract: a grpc.aio handler that makes its own
tokens, one per `--step-ms`, with no engine, no workers and no IPC.

A reference for the serving-overhead benchmark: whatever latency it adds over the step is the
cost of grpc.aio and the client on this machine, not of cadence.

With `--step-ms 0` it sends every chunk as soon as gRPC takes the previous one, one token
each and never merged: a source of small chunks as fast as one grpc.aio process can send,
to measure how many chunks a client keeps up with (benchmarks/client_capacity.py).

    python benchmarks/plain_grpc_reference.py --port 0 --step-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

import grpc

from cadence import event_loop
from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc


class PlainInference(pb_grpc.InferenceServicer):
    """One token per step, each stream on its own timer; with `include_timing` each chunk
    carries the timing the contract promises, as cadence's do (the same bytes on the wire):
    the step is the timer's tick, and the token reaches the "front" when the tick ends."""

    def __init__(self, step_s: float) -> None:
        self._step_s = step_s

    async def Generate(self, request, context):
        received_ns = time.monotonic_ns()
        loop = asyncio.get_running_loop()
        next_at = loop.time()  # time.monotonic(), as the timing's clock
        step_ns = int(self._step_s * 1e9)
        for i in range(request.max_tokens):
            next_at += self._step_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            chunk = pb.GenerateChunk(
                request_id=request.request_id,
                index=i,
                token_ids=[65],
                text="A",
                finish_reason=pb.FINISH_REASON_LENGTH if i == request.max_tokens - 1 else 0,
            )
            if request.include_timing:
                t = chunk.timing
                t.step_end_ns = t.front_recv_ns = int(next_at * 1e9)
                t.step_start_ns = t.step_end_ns - step_ns
                if i == 0:
                    t.received_ns = t.scheduled_ns = received_ns
                t.send_ns = time.monotonic_ns()
            yield chunk


class Firehose:
    """`--step-ms 0`: every chunk serialized before the stream starts, then written back to
    back, so that per chunk the server spends only gRPC's own cost of a write."""

    def __init__(self) -> None:
        self._chunks: dict[tuple[int, bool], list[bytes]] = {}

    def _serialized(self, tokens: int, timing: bool) -> list[bytes]:
        key = (tokens, timing)
        if key not in self._chunks:
            chunks = [
                pb.GenerateChunk(request_id="firehose", index=i, token_ids=[65], text="A")
                for i in range(tokens)
            ]
            chunks[-1].finish_reason = pb.FINISH_REASON_LENGTH
            if timing:  # the size of cadence's timed chunks; the times mean nothing here
                now = time.monotonic_ns()
                for chunk in chunks:
                    t = chunk.timing
                    t.step_start_ns = t.step_end_ns = t.front_recv_ns = t.send_ns = now
            self._chunks[key] = [c.SerializeToString() for c in chunks]
        return self._chunks[key]

    async def Generate(self, raw: bytes, context):
        request = pb.GenerateRequest.FromString(raw)
        for data in self._serialized(request.max_tokens, request.include_timing):
            yield data

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "cadence.v1.Inference",
            {"Generate": grpc.unary_stream_rpc_method_handler(self.Generate)},
        )


async def main(port: int, step_ms: float) -> None:
    server = grpc.aio.server()
    if step_ms:
        pb_grpc.add_InferenceServicer_to_server(PlainInference(step_ms / 1e3), server)
    else:
        server.add_generic_rpc_handlers([Firehose().handler()])
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
    event_loop.run(main(args.port, args.step_ms))  # the loop cadence's front runs on
