"""A user's own token-streaming gRPC service, in two designs: one shared queue, or one per request.

This file plays a service that someone else wrote: it imports nothing from cadence. It serves
`tokens.v1.TokenService/Generate` (tokens.proto, next to this file; the messages are built at
run time by `grpc.protos_and_services`, so nobody generates stubs), plus the health service and
server reflection, so that `cadence bench --protocol grpc` can drive it.

Both designs share one "engine" thread that models a batched accelerator: every `--step-ms`
(on an absolute monotonic clock, so it does not drift) it emits one token for every active
request, then hands the batch over, then sleeps until the next step. A request joins at the
next step boundary and gets its first token one step later; it leaves after `max_tokens`
tokens (indices 0..max_tokens-1, text f"t{index} "), or within one step of being cancelled or
of its deadline. Both designs send identical token streams; only the plumbing differs.

--design shared (the common one): a sync `grpc.server` whose
ThreadPoolExecutor has `--threads` workers. The engine puts every token into ONE shared bounded
`queue.Queue(maxsize=--queue-capacity)` and blocks when it is full (the engine stalls for every
request). Each handler holds its pool thread for its whole stream, waiting for its next token.
Tokens for another stream are handed over through per-stream mailboxes and a Condition, so
every waiting thread wakes for everybody's output. Streams beyond `--threads` wait for a free
thread before their handler runs at all, so their request reaches the engine only then: the
time to first token grows in waves of `--threads` streams, each wave a whole stream long.

--design per-request: a `grpc.aio` server. Each request has its own
bounded asyncio queue (capacity `--queue-capacity`) bound to that request: its id, its deadline
and its cancellation. The engine hands each step's tokens to the event loop with ONE
`loop.call_soon_threadsafe` per step; the handler is an async generator awaiting its own queue,
so waiting for a result holds no thread ("wait" and "send" are split) and the number of open
streams is not limited by threads. Here `--threads` only sizes the ThreadPoolExecutor given to
grpc.aio as its migration_thread_pool and set as the loop's default executor; this service runs
nothing there, so it should make no difference, which is the point of the comparison.

    python examples/thread_pool/server.py --design shared --threads 4 --port 50051
    python examples/thread_pool/server.py --design per-request --port 50051

It prints one line, `listening on HOST:PORT`, once serving, and stops on SIGTERM (1 s grace).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # protos_and_services resolves "tokens.proto" against sys.path
    sys.path.insert(0, HERE)
tokens_pb2, tokens_pb2_grpc = grpc.protos_and_services("tokens.proto")

SERVICE_NAME = tokens_pb2.DESCRIPTOR.services_by_name["TokenService"].full_name
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]  # a taken --port is an error, not a shared port
READ_POLL_S = 0.05
"""shared design: how long the reading thread waits on the shared queue before it re-checks
whether its own stream was cancelled (and lets another thread read)."""

log = logging.getLogger("thread_pool_example")


def bind(server, args: argparse.Namespace) -> int | None:
    """The bound port, or None (and a line on stderr) when HOST:PORT cannot be bound."""
    try:
        return server.add_insecure_port(f"{args.host}:{args.port}")
    except RuntimeError as exc:
        print(f"cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr, flush=True)
        return None


class Request:
    """One stream as the engine sees it. `cancelled` is set by the RPC side, read by the engine."""

    _keys = itertools.count(1)

    def __init__(self, request_id: str, max_tokens: int, time_remaining: float | None):
        # The internal key, not the client's request_id: ids may be empty or repeated.
        self.key = next(Request._keys)
        self.request_id = request_id
        self.max_tokens = max_tokens
        # grpc reports "no deadline" as None or as a huge number of seconds.
        self.deadline = (
            time.monotonic() + time_remaining
            if time_remaining is not None and time_remaining < 1e8
            else None
        )
        self.cancelled = False
        self.next_index = 0
        # Credits (per-request design only). `produced` is written only by the engine thread
        # and `consumed` only by the handler, so reading both needs no lock.
        self.capacity: int | None = None
        self.produced = 0
        self.consumed = 0
        self.queue: asyncio.Queue[tuple[int, str]] | None = None

    def cancel(self) -> None:
        self.cancelled = True

    def can_emit(self) -> bool:
        return self.capacity is None or self.produced - self.consumed < self.capacity

    def gone(self, now: float) -> str | None:
        if self.cancelled:
            return "cancelled"
        if self.deadline is not None and now >= self.deadline:
            return "deadline"
        return None


Batch = list[tuple[Request, int, str]]


class Engine:
    """The batched accelerator: one token per active request per step, on a fixed clock."""

    def __init__(self, step_s: float, deliver: Callable[[Batch], None]):
        self._step = step_s
        self._deliver = deliver  # called on the engine thread, once per step with tokens
        self._cond = threading.Condition()
        self._joining: list[Request] = []
        self._active: list[Request] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=2.0)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def submit(self, req: Request) -> None:
        """Join at the next step boundary (from any thread)."""
        with self._cond:
            self._joining.append(req)
            self._cond.notify()

    def _run(self) -> None:
        origin = time.monotonic()
        boundary = origin
        while True:
            with self._cond:
                while not (self._stop.is_set() or self._active or self._joining):
                    self._cond.wait()  # idle: no requests, no clock ticks
            if self._stop.is_set():
                return
            # Absolute schedule: the next boundary on the origin + k*step grid. After a stall
            # (shared queue full) or an idle spell, missed steps are skipped, not replayed.
            boundary += self._step
            now = time.monotonic()
            if boundary < now:
                boundary = origin + math.ceil((now - origin) / self._step) * self._step
            if self._stop.wait(max(0.0, boundary - now)):
                return
            batch: Batch = []
            with self._cond:
                now = time.monotonic()
                keep = []
                for req in self._active:
                    why = req.gone(now)
                    if why is not None:
                        self._left(req, why)
                        continue
                    if req.can_emit():
                        batch.append((req, req.next_index, f"t{req.next_index} "))
                        req.next_index += 1
                        req.produced += 1
                    if req.next_index >= req.max_tokens:
                        self._left(req, "done")
                    else:
                        keep.append(req)
                # Joiners start now; their first token comes with the next step.
                keep.extend(self._joining)
                self._joining.clear()
                self._active = keep
            if batch:
                self._deliver(batch)

    def _left(self, req: Request, why: str) -> None:
        log.info(
            "engine: request %s (%r) left, %s after %d tokens",
            req.key,
            req.request_id,
            why,
            req.next_index,
        )


# ---------------------------------------------------------------------------------------------
# design "shared": one queue for all, made correct for many concurrent streams


class SharedQueueHub:
    """ONE bounded queue for all requests (`inference_result_queue`).

    The simplest correct way for many handlers to read one queue: at most one handler at a time
    blocks on the shared queue (the "reader"); it files what it takes into per-stream mailboxes
    and wakes every waiting handler (notify_all), which looks for its own token and otherwise
    goes back to sleep or takes its turn as the reader. No token is lost or sent to the wrong
    stream, and each stream's tokens stay in order (one FIFO, one reader at a time). The costs
    of the design stay: each stream holds a pool thread while it waits, threads wake for
    other streams' output, and when the queue is full the engine stalls for everybody
    (head-of-line blocking). The mailboxes are unbounded; the shared queue is the only bound.
    """

    def __init__(self, capacity: int):
        self.queue: queue.Queue[tuple[int, int, str]] = queue.Queue(maxsize=capacity)
        self._cond = threading.Condition()
        self._boxes: dict[int, collections.deque[tuple[int, str]]] = {}
        self._reading = False
        self._closed = False

    def open(self, req: Request) -> None:
        with self._cond:
            self._boxes[req.key] = collections.deque()

    def close(self, req: Request) -> None:
        """The stream is over: the engine drops it, its late tokens are discarded."""
        req.cancel()
        with self._cond:
            self._boxes.pop(req.key, None)
            self._cond.notify_all()

    def cancel(self, req: Request) -> None:
        """RPC callback (cancelled, deadline, or finished): wake the handler if it waits."""
        req.cancel()
        with self._cond:
            self._cond.notify_all()

    def shutdown(self) -> None:
        self._closed = True

    def deliver(self, batch: Batch) -> None:
        """Engine thread: a blocking put per token; a full queue stalls the whole engine."""
        t0 = time.monotonic()
        for req, index, text in batch:
            while not (req.cancelled or self._closed):  # nobody reads a cancelled one's tokens
                try:
                    self.queue.put((req.key, index, text), timeout=READ_POLL_S)
                    break
                except queue.Full:
                    continue
        stalled = time.monotonic() - t0
        if stalled > 0.005:
            log.info("engine: stalled %.1f ms on the full shared queue", stalled * 1e3)

    def next_token(self, req: Request) -> tuple[int, str] | None:
        """Block (holding the caller's pool thread) until req's next token; None if cancelled."""
        while True:
            with self._cond:
                while True:
                    box = self._boxes.get(req.key)
                    if req.cancelled or box is None:
                        return None
                    if box:
                        return box.popleft()
                    if not self._reading:
                        self._reading = True  # our turn to read the shared queue
                        break
                    self._cond.wait()  # woken for every batch, whoever's tokens it holds
            taken: list[tuple[int, int, str]] = []
            try:
                taken.append(self.queue.get(timeout=READ_POLL_S))
                while True:
                    taken.append(self.queue.get_nowait())
            except queue.Empty:
                pass
            finally:
                with self._cond:
                    self._reading = False
                    for key, index, text in taken:
                        box = self._boxes.get(key)
                        if box is not None:  # else: a finished or cancelled stream's token
                            box.append((index, text))
                    self._cond.notify_all()


class SharedServicer(tokens_pb2_grpc.TokenServiceServicer):
    def __init__(self, hub: SharedQueueHub, engine: Engine):
        self._hub = hub
        self._engine = engine

    def Generate(self, request, context: grpc.ServicerContext) -> Iterator:
        # This runs only once a pool thread is free, and then holds it to the end of the stream.
        if request.max_tokens <= 0:
            return
        req = Request(request.request_id, request.max_tokens, context.time_remaining())
        self._hub.open(req)
        try:
            if not context.add_callback(lambda: self._hub.cancel(req)):
                return  # the RPC ended (client gone, deadline) while it waited for a thread
            self._engine.submit(req)
            while True:
                item = self._hub.next_token(req)
                if item is None:
                    return
                index, text = item
                yield tokens_pb2.Token(index=index, text=text)
                if index >= req.max_tokens - 1:
                    return
        finally:
            self._hub.close(req)


def serve_shared(args: argparse.Namespace) -> int:
    hub = SharedQueueHub(args.queue_capacity)
    engine = Engine(args.step_ms / 1e3, hub.deliver)
    executor = ThreadPoolExecutor(max_workers=args.threads, thread_name_prefix="handler")
    # Health and reflection calls share this pool too: under load they queue behind streams.
    server = grpc.server(executor, options=SERVER_OPTIONS)
    tokens_pb2_grpc.add_TokenServiceServicer_to_server(SharedServicer(hub, engine), server)
    health_servicer = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = bind(server, args)
    if port is None:
        return 1
    engine.start()
    server.start()
    print(f"listening on {args.host}:{port}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    health_servicer.enter_graceful_shutdown()
    server.stop(1.0).wait()
    hub.shutdown()
    engine.stop()
    executor.shutdown(wait=False, cancel_futures=True)
    return 0


# ---------------------------------------------------------------------------------------------
# design "per-request": one bounded queue per request


class PerRequestServicer(tokens_pb2_grpc.TokenServiceServicer):
    def __init__(self, engine: Engine, capacity: int):
        self._engine = engine
        self._capacity = capacity

    async def Generate(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        if request.max_tokens <= 0:
            return
        req = Request(request.request_id, request.max_tokens, context.time_remaining())
        req.capacity = self._capacity
        req.queue = asyncio.Queue(maxsize=self._capacity)
        context.add_done_callback(lambda _ctx: req.cancel())
        self._engine.submit(req)
        try:
            while True:
                index, text = await req.queue.get()  # holds no thread while it waits
                req.consumed += 1
                yield tokens_pb2.Token(index=index, text=text)
                if index >= req.max_tokens - 1:
                    return
        finally:
            req.cancel()  # cancellation / deadline: the engine drops it at the next step


def on_step(batch: Batch) -> None:
    """Event loop: one call per engine step, filing each token into its request's queue.

    Policy for a full queue (a stream whose client reads slower than the engine writes): the
    engine makes no token for that request in that step (`Request.can_emit`: tokens produced
    minus tokens taken by the handler < capacity), so that one request pauses, keeps its place
    in the batch and resumes when its handler catches up; other requests are not delayed and
    nothing is dropped. So put_nowait below cannot overflow.
    """
    for req, index, text in batch:
        if not req.cancelled:
            req.queue.put_nowait((index, text))


async def serve_per_request(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=args.threads, thread_name_prefix="pool")
    loop.set_default_executor(executor)  # unused by this service: --threads changes nothing

    def deliver(batch: Batch) -> None:  # engine thread: one hand-over per step, not per token
        try:
            loop.call_soon_threadsafe(on_step, batch)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    engine = Engine(args.step_ms / 1e3, deliver)
    server = grpc.aio.server(migration_thread_pool=executor, options=SERVER_OPTIONS)
    tokens_pb2_grpc.add_TokenServiceServicer_to_server(
        PerRequestServicer(engine, args.queue_capacity), server
    )
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = bind(server, args)
    if port is None:
        return 1
    engine.start()
    await server.start()
    print(f"listening on {args.host}:{port}", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(1.0)
    engine.stop()
    executor.shutdown(wait=False, cancel_futures=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--design", choices=("shared", "per-request"), default="shared")
    p.add_argument("--threads", type=int, default=4, help="pool size (default 4)")
    p.add_argument("--queue-capacity", type=int, default=64, help="queue bound (default 64)")
    p.add_argument("--step-ms", type=float, default=20.0, help="engine step (default 20 ms)")
    p.add_argument("--port", type=int, default=0, help="0 = any free port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--verbose", action="store_true", help="log engine events to stderr")
    args = p.parse_args(argv)
    if args.threads < 1 or args.queue_capacity < 1 or args.step_ms <= 0:
        p.error("--threads and --queue-capacity must be >= 1, --step-ms > 0")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(message)s",
    )
    if args.design == "shared":
        return serve_shared(args)
    return asyncio.run(serve_per_request(args))


if __name__ == "__main__":
    sys.exit(main())
