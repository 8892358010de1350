"""A plain grpc.aio token service with one planted fault, for the client-side diagnosis tests.

    python tests/planted_server.py --fault none|pause|setup|skip|errors|die|cpu|batch|slow-subset|first|swap|rare-slow [--port 0] [--gap-ms 20] [--max-streams N]

It speaks the worked example's proto (examples/thread_pool/tokens.proto, reflection on):
each stream gets `max_tokens` Tokens, the first after one gap, then one per gap on an
absolute schedule. Faults:
- `pause`: the event loop is blocked (time.sleep) for `--pause-ms` every `--pause-every-ms`,
  so every open stream stalls at the same instants (a blocking call in async code);
- `setup`: each call holds one lock for `--setup-ms` before its first token, so calls are
  taken in one at a time (a slow per-call set-up);
- `skip`: every stream leaves out its token 5 (a lost token the integrity check must see);
- `errors`: after `--after-calls` calls, every call is answered UNAVAILABLE (a server that
  answers only errors mid-run);
- `die`: the call after `--after-calls` calls ends the process (a server that dies mid-run);
- `cpu`: each token costs `--cpu-ms` of computation on the event loop's thread (a server
  held to one core);
- `batch`: tokens are held back and sent `--batch` per message (`count`), on a steady timer;
- `slow-subset`: every fourth stream gets its tokens `--slow-factor` times slower (a slower
  card or replica behind part of the streams);
- `first`: every stream waits `--first-ms` before its first token, however few are open;
- `swap`: the first call of more than 4 tokens has its tokens 3 and 4 go out in each other's place (one reorder in the run);
- `rare-slow`: each gap is, at random one time in `--rare-every`, longer by 0.4-1.6 times
  `--rare-ms` (a bad tail of a shape no diagnosis rule knows: no fixed value, no pattern);
- `none`: a clean server.
`--max-streams N` (with any fault) sets the server's HTTP/2 concurrent-stream limit per
connection (grpc.max_concurrent_streams).
`--otlp-endpoint URL` traces the service as any grpc-python service would be: OpenTelemetry's
SDK and `opentelemetry-instrumentation-grpc` (one server span per call, in the caller's trace),
exported over OTLP/gRPC; the `first` fault's wait is then a child span named `queue`.
It prints `listening on HOST:PORT` once serving and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import time

import grpc
from grpc_reflection.v1alpha import reflection

_PROTO_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "examples", "thread_pool"
)


def _messages():
    import sys

    sys.path.insert(0, os.path.abspath(_PROTO_DIR))
    return grpc.protos_and_services("tokens.proto")


def _traced(endpoint: str):
    """Instrument grpc.aio servers and return a tracer for the service's own spans."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorServer
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "planted"}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=200)
    )
    trace.set_tracer_provider(provider)
    GrpcAioInstrumentorServer().instrument()
    return provider, trace.get_tracer("planted")


async def main(args: argparse.Namespace) -> None:
    protos, services = _messages()
    provider, tracer = _traced(args.otlp_endpoint) if args.otlp_endpoint else (None, None)
    setup_lock = asyncio.Lock()
    rare = random.Random(args.seed)
    calls = swaps = 0

    class TokenService(services.TokenServiceServicer):
        async def Generate(self, request, context):
            nonlocal calls, swaps
            calls += 1
            if args.fault == "die" and calls > args.after_calls:
                os._exit(3)  # the planted fault: the server dies, its streams with it
            if args.fault == "errors" and calls > args.after_calls:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "planted: only errors now")
            if args.fault == "setup":
                async with setup_lock:
                    await asyncio.sleep(args.setup_ms / 1e3)
            gap = args.gap_ms / 1e3
            if args.fault == "slow-subset" and calls % 4 == 0:
                gap *= args.slow_factor  # the planted fault: a quarter of the streams slower
            if args.fault == "first":
                if tracer is not None:
                    with tracer.start_as_current_span("queue"):
                        await asyncio.sleep(args.first_ms / 1e3)
                else:
                    await asyncio.sleep(args.first_ms / 1e3)  # the planted fault: a slow start
            t0 = time.monotonic()
            if args.fault == "batch":
                # The planted fault: tokens held back and sent `--batch` at a time, on a timer.
                for first in range(0, request.max_tokens, args.batch):
                    n = min(args.batch, request.max_tokens - first)
                    delay = t0 + (first + n) * gap - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    yield protos.Token(
                        index=first,
                        count=n,
                        text="".join(f"t{i} " for i in range(first, first + n)),
                    )
                return
            swapped = args.fault == "swap" and not swaps and request.max_tokens > 4
            swaps += swapped
            for i in range(request.max_tokens):
                if args.fault == "rare-slow" and rare.random() < 1 / args.rare_every:
                    # The planted fault: this gap, and no other, late by 0.4-1.6 x --rare-ms.
                    t0 += rare.uniform(0.4, 1.6) * args.rare_ms / 1e3
                delay = t0 + (i + 1) * gap - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if swapped and i in (3, 4):
                    i = 7 - i  # the planted fault: tokens 3 and 4 in each other's place
                if args.fault == "cpu":
                    spin_until = time.perf_counter() + args.cpu_ms / 1e3
                    while time.perf_counter() < spin_until:
                        pass  # the planted fault: per-token work on the event loop's thread
                if args.fault != "skip" or i != 5:
                    yield protos.Token(index=i, text=f"t{i} ", count=1)

    options = [("grpc.max_concurrent_streams", args.max_streams)] if args.max_streams else []
    server = grpc.aio.server(options=options)
    services.add_TokenServiceServicer_to_server(TokenService(), server)
    name = protos.DESCRIPTOR.services_by_name["TokenService"].full_name
    reflection.enable_server_reflection((name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    print(f"listening on {args.host}:{port}", flush=True)

    async def block_the_loop() -> None:
        while True:
            await asyncio.sleep(args.pause_every_ms / 1e3)
            time.sleep(args.pause_ms / 1e3)  # noqa: ASYNC251 (the planted fault: a blocking call)

    if args.fault == "pause":
        pauses = asyncio.ensure_future(block_the_loop())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    if args.fault == "pause":
        pauses.cancel()
    await server.stop(0.5)
    if provider is not None:
        provider.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--fault",
        choices=[
            "none",
            "pause",
            "setup",
            "skip",
            "errors",
            "die",
            "cpu",
            "batch",
            "slow-subset",
            "first",
            "swap",
            "rare-slow",
        ],
        default="none",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--pause-ms", type=float, default=120.0)
    parser.add_argument("--pause-every-ms", type=float, default=400.0)
    parser.add_argument("--setup-ms", type=float, default=15.0)
    parser.add_argument("--after-calls", type=int, default=20)
    parser.add_argument("--cpu-ms", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--slow-factor", type=float, default=2.5)
    parser.add_argument("--first-ms", type=float, default=150.0)
    parser.add_argument("--rare-every", type=float, default=30.0)
    parser.add_argument("--rare-ms", type=float, default=150.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-streams",
        type=int,
        default=0,
        help="HTTP/2 concurrent streams per connection (0: no limit)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default="",
        help="export OpenTelemetry spans (grpc instrumentation) to this URL",
    )
    asyncio.run(main(parser.parse_args()))
