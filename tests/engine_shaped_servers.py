"""Planted servers shaped like real LLM engines, for the coincidence diagnosis tests.

    python tests/engine_shaped_servers.py --front grpc|sse [--port 0] [engine options]

One engine task per card steps a batch of every running stream (continuous batching, as
vLLM, SGLang and TGI do): each step admits the streams waiting on that card, takes
`--decode-ms` (times a jitter), and ends with one token for every stream in the batch, the
admitted ones' first included. Streams go to the cards in turn. The front is
- `grpc`: grpc.aio with a method of its own (tests/engine_shaped.proto,
  `engine.v1.Engine/Complete`, reflection on): one `Piece` message per token;
- `sse`: aiohttp speaking OpenAI's completions stream (`POST /v1/completions`,
  `stream: true`): one `data:` event per token, then a usage event and `[DONE]`.

Faults, any of which combine:
- `--prefill-ms` / `--prefill-ms-per-token`: the step that admits streams also runs their
  prefill, per stream and per prompt character: every stream on the card waits for it;
- `--serial --token-ms`: no batching, the engine makes one token for one stream at a time, in
  turn, so a stream's gap is the streams open times `--token-ms`;
- `--slow-card-factor F` with `--cards N`: the last card steps F times slower;
- `--pause-ms` every `--pause-every-ms`: the whole process blocks (time.sleep: a collection,
  a blocking call on the loop);
- `--flush-events N` (sse): the writer holds events and writes them N at a time;
- `--max-batch N`: at most N streams run on a card, the rest wait for a slot;
- `--lost-wakeup-share S`: the engine's hand-off to a stream misses that share of its
  notifications, and the stream's reader wakes on its `--poll-ms` timeout instead (then
  sends what piled up, back to back).
- `--no-kv-cache-ms-per-token X`: no KV cache, each step recomputes every running stream's
  prompt and output so far, X ms per token of that context;
- `--leak-ms-per-step X`: the card keeps a record of every step it made and scans them all
  each step, X ms per record (a leak);
- `--prefill-ms-per-token-squared X`: each stream's prefill, on a prefill instance of its own
  before it joins the decode batch, takes X ms times its prompt's length squared (attention
  over the prompt without a flash kernel);
- `--block-tokens K --block-ms M`: a stream that fills a block of K tokens waits out of the
  batch M ms for its next block to be allocated (the others go on);
- `--order-by-length shortest|longest` with `--max-batch N`: the waiting streams are admitted
  by their output budget, shortest (or longest) first;
- `--token-budget B`: the card runs streams whose output budgets (`max_tokens`) add up to at
  most B (a KV cache reserved for each stream's whole output), admitting the shortest first
  among those that fit (no cap on the count of streams);
- `--sync-every K --sync-ms M`: each stream's front, after every K outputs it sent, writes
  the stream's transcript so far to storage and waits M ms for it (the engine goes on; what
  it made meanwhile goes out after).
- `--duplicate-event P` / `--drop-event P` (sse): each stream's writer sends its event at
  position P twice (a retry that resends) or never (a hand-off that overwrites); the usage
  still counts the outputs the engine made.
`--jitter` is the standard deviation of a step as a share of it (a clean server varies too).
It prints `listening on HOST:PORT` once serving and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator

_HERE = os.path.dirname(os.path.abspath(__file__))
METHOD = "engine.v1.Engine/Complete"
REQUEST_JSON = '{"id": "{request_id}", "prompt": "{prompt}", "max_new_tokens": "{max_tokens}"}'
MODEL = "engine-shaped"


class Stream:
    """One request inside the engine: the positions made and not yet read by its front."""

    def __init__(self, engine: Engine, prompt_chars: int, max_tokens: int) -> None:
        self.engine = engine
        self.prompt_chars = prompt_chars
        self.max_tokens = max(1, max_tokens)
        self.made = 0
        self.ready: collections.deque[int] = collections.deque()
        self.wake = asyncio.Event()
        self.deaf = False
        """A notification was lost: the reader hears nothing more until its poll timeout."""
        self.cancelled = False
        self.parked_until = 0.0
        """The planted fault `--block-tokens`: out of the batch until its next block is there."""

    @property
    def finished(self) -> bool:
        return self.made >= self.max_tokens

    def push(self) -> None:
        self.ready.append(self.made)
        self.made += 1
        if self.engine.rng.random() < self.engine.args.lost_wakeup_share:
            self.deaf = True  # the planted fault: this notification is lost
        if not self.deaf:
            self.wake.set()

    async def outputs(self) -> AsyncIterator[list[int]]:
        """Every position as it is made, a list of those that piled up at a time."""
        poll = self.engine.args.poll_ms / 1e3 if self.engine.args.lost_wakeup_share else None
        while True:
            if self.ready:
                batch = list(self.ready)
                self.ready.clear()
                yield batch
                continue
            if self.finished:
                return
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), poll)
            except TimeoutError:
                self.deaf = False  # the planted fault: what piled up is found on the timeout


class Card:
    """One engine loop stepping its batch."""

    def __init__(self, engine: Engine, number: int, step_ms: float) -> None:
        self.engine = engine
        self.number = number
        self.step_ms = step_ms
        self.waiting: collections.deque[Stream] = collections.deque()
        self.running: list[Stream] = []
        self.work = asyncio.Event()
        self.history: list[float] = []
        """The planted fault `--leak-ms-per-step`: every step's record, kept and scanned."""

    async def run(self) -> None:
        args, rng = self.engine.args, self.engine.rng
        while True:
            if not self.running and not self.waiting:
                self.work.clear()
                await self.work.wait()
            started = time.monotonic()
            admitted = []
            if args.order_by_length:  # the planted fault: a scheduler that orders by length
                self.waiting = collections.deque(
                    sorted(
                        self.waiting,
                        key=lambda s: s.max_tokens,
                        reverse=args.order_by_length == "longest",
                    )
                )
            if args.token_budget:  # the planted fault: a KV cache reserved per whole output
                held = sum(s.max_tokens for s in self.running)
                for stream in sorted(self.waiting, key=lambda s: s.max_tokens):
                    if held + stream.max_tokens <= args.token_budget or not self.running:
                        held += stream.max_tokens
                        self.waiting.remove(stream)
                        self.running.append(stream)
                        admitted.append(stream)
            while (
                self.waiting
                and not args.token_budget
                and (not args.max_batch or len(self.running) < args.max_batch)
            ):
                stream = self.waiting.popleft()
                self.running.append(stream)
                admitted.append(stream)
            step = self.step_ms * max(0.2, rng.gauss(1.0, args.jitter))
            if admitted:  # the planted fault: prefill inside the decode step
                step += args.prefill_ms * len(admitted)
                step += args.prefill_ms_per_token * sum(s.prompt_chars for s in admitted)
            # The planted faults: a context recomputed every step, a history scanned.
            step += args.no_kv_cache_ms_per_token * sum(
                s.prompt_chars + s.made for s in self.running
            )
            step += args.leak_ms_per_step * len(self.history)
            self.history.append(started)
            await asyncio.sleep(max(0.0, started + step / 1e3 - time.monotonic()))
            now = time.monotonic()
            for stream in self.running:
                if not stream.cancelled and stream.parked_until <= now:
                    stream.push()
                    if args.block_tokens and stream.made % args.block_tokens == 0:
                        stream.parked_until = now + args.block_ms / 1e3  # the planted fault
            self.running = [s for s in self.running if not (s.finished or s.cancelled)]


class SerialEngine:
    """The planted fault `--serial`: one token for one stream at a time, in turn."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.waiting: collections.deque[Stream] = collections.deque()
        self.work = asyncio.Event()

    async def run(self) -> None:
        token_s = self.engine.args.token_ms / 1e3
        running: collections.deque[Stream] = collections.deque()
        while True:
            running.extend(self.waiting)
            self.waiting.clear()
            if not running:
                self.work.clear()
                await self.work.wait()
                continue
            stream = running.popleft()
            if stream.cancelled:
                continue
            started = time.monotonic()
            await asyncio.sleep(max(0.0, started + token_s - time.monotonic()))
            stream.push()
            if not stream.finished:
                running.append(stream)


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        if args.serial:
            self.cards: list = [SerialEngine(self)]
        else:
            self.cards = [
                Card(
                    self,
                    n,
                    args.decode_ms * (args.slow_card_factor if n == args.cards - 1 else 1.0),
                )
                for n in range(args.cards)
            ]
        self.submitted = 0

    def start(self) -> list[asyncio.Task]:
        tasks = [asyncio.ensure_future(card.run()) for card in self.cards]
        if self.args.pause_ms:
            tasks.append(asyncio.ensure_future(self._pauses()))
        return tasks

    async def _pauses(self) -> None:
        while True:
            await asyncio.sleep(self.args.pause_every_ms / 1e3)
            time.sleep(self.args.pause_ms / 1e3)  # noqa: ASYNC251 (the planted fault: the process stops)

    def submit(self, prompt_chars: int, max_tokens: int) -> Stream:
        stream = Stream(self, prompt_chars, max_tokens)
        card = self.cards[self.submitted % len(self.cards)]
        self.submitted += 1
        prefill_s = self.args.prefill_ms_per_token_squared * prompt_chars**2 / 1e3
        if prefill_s:  # the planted fault: prefill on an instance of its own, as the square
            asyncio.get_running_loop().call_later(prefill_s, self._join, card, stream)
        else:
            self._join(card, stream)
        return stream

    @staticmethod
    def _join(card, stream: Stream) -> None:
        card.waiting.append(stream)
        card.work.set()


def _syncing(args: argparse.Namespace):
    """The planted fault `--sync-every`: after every K outputs sent, a wait for storage."""

    async def sync(position: int) -> None:
        if args.sync_every and (position + 1) % args.sync_every == 0:
            await asyncio.sleep(args.sync_ms / 1e3)

    return sync


async def serve_grpc(engine: Engine, args: argparse.Namespace) -> tuple[object, int]:
    import grpc
    from grpc_reflection.v1alpha import reflection

    sys.path.insert(0, _HERE)
    protos, services = grpc.protos_and_services("engine_shaped.proto")
    _sync = _syncing(args)

    class EngineService(services.EngineServicer):
        async def Complete(self, request, context):
            stream = engine.submit(len(request.prompt), request.max_new_tokens)
            try:
                async for positions in stream.outputs():
                    for position in positions:
                        yield protos.Piece(position=position, text=f"t{position} ")
                        await _sync(position)
            finally:
                stream.cancelled = True

    server = grpc.aio.server()
    services.add_EngineServicer_to_server(EngineService(), server)
    name = protos.DESCRIPTOR.services_by_name["Engine"].full_name
    reflection.enable_server_reflection((name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    return server, port


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def serve_sse(engine: Engine, args: argparse.Namespace) -> tuple[object, int]:
    from aiohttp import web

    _sync = _syncing(args)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stream = engine.submit(len(body.get("prompt") or ""), int(body.get("max_tokens") or 16))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        held: list[bytes] = []
        try:
            async for positions in stream.outputs():
                for position in positions:
                    event = _event(
                        {
                            "object": "text_completion",
                            "model": MODEL,
                            "choices": [
                                {"index": 0, "text": f"t{position} ", "finish_reason": None}
                            ],
                        }
                    )
                    if position == args.drop_event:  # the planted fault
                        continue
                    held.append(event)
                    if position == args.duplicate_event:  # the planted fault
                        held.append(event)
                    if len(held) >= args.flush_events:  # the planted fault when above 1
                        await response.write(b"".join(held))
                        held.clear()
                    await _sync(position)
            held.append(
                _event(
                    {
                        "object": "text_completion",
                        "model": MODEL,
                        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                    }
                )
            )
            held.append(
                _event(
                    {
                        "object": "text_completion",
                        "model": MODEL,
                        "choices": [],
                        "usage": {"completion_tokens": stream.made},
                    }
                )
            )
            held.append(b"data: [DONE]\n\n")
            await response.write(b"".join(held))
        finally:
            stream.cancelled = True
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    return runner, runner.addresses[0][1]


async def main(args: argparse.Namespace) -> None:
    engine = Engine(args)
    tasks = engine.start()
    server, port = await (serve_grpc if args.front == "grpc" else serve_sse)(engine, args)
    print(f"listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for task in tasks:
        task.cancel()
    if args.front == "grpc":
        await server.stop(0.5)
    else:
        await server.cleanup()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--front", choices=["grpc", "sse"], default="grpc")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cards", type=int, default=1)
    p.add_argument("--decode-ms", type=float, default=10.0)
    p.add_argument("--jitter", type=float, default=0.0)
    p.add_argument("--prefill-ms", type=float, default=0.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    p.add_argument("--serial", action="store_true")
    p.add_argument("--token-ms", type=float, default=3.0)
    p.add_argument("--slow-card-factor", type=float, default=1.0)
    p.add_argument("--pause-ms", type=float, default=0.0)
    p.add_argument("--pause-every-ms", type=float, default=500.0)
    p.add_argument("--flush-events", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=0)
    p.add_argument("--lost-wakeup-share", type=float, default=0.0)
    p.add_argument("--poll-ms", type=float, default=50.0)
    p.add_argument("--no-kv-cache-ms-per-token", type=float, default=0.0)
    p.add_argument("--leak-ms-per-step", type=float, default=0.0)
    p.add_argument("--prefill-ms-per-token-squared", type=float, default=0.0)
    p.add_argument("--block-tokens", type=int, default=0)
    p.add_argument("--block-ms", type=float, default=0.0)
    p.add_argument("--order-by-length", choices=["shortest", "longest"], default=None)
    p.add_argument("--token-budget", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=0)
    p.add_argument("--sync-ms", type=float, default=0.0)
    p.add_argument("--duplicate-event", type=int, default=-1)
    p.add_argument("--drop-event", type=int, default=-1)
    return p


if __name__ == "__main__":
    asyncio.run(main(parser().parse_args()))
