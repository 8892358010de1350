"""The bare SSE reference: the chosen HTTP library (aiohttp on uvloop) with no cadence code,
answering `POST /v1/completions` with `stream: true` the way cadence's workers pace tokens:
one timer wakes every open stream at one instant per `--step-ms`, and each writes one event
(one token, the letter "a") until its `max_tokens`.

A reference for benchmarks/openai_overhead.py: whatever latency and CPU it shows is the cost
of aiohttp, SSE and the client on this machine, not of cadence. With `cadence_timing: true`
each event carries cadence's timing extension, the step's end being the timer's wake-up, so
the lab's token delay (arrival - step end) means the same as against cadence.

    python benchmarks/sse_reference.py --port 0 --step-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvloop
from aiohttp import web


class Ticker:
    """One timer for all streams: every step it wakes every waiting stream at once."""

    def __init__(self, step_s: float) -> None:
        self._step_s = step_s
        self._waiters: list[asyncio.Future] = []
        self._handle: asyncio.TimerHandle | None = None

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        waiters, self._waiters = self._waiters, []
        self._handle = loop.call_later(self._step_s, self._tick) if waiters else None
        now = time.monotonic_ns()
        for future in waiters:
            if not future.done():
                future.set_result(now)

    def wait(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if self._handle is None:
            self._handle = loop.call_later(self._step_s, self._tick)
        future = loop.create_future()
        self._waiters.append(future)
        return future


def make_app(step_s: float) -> web.Application:
    ticker = Ticker(step_s)
    step_ns = int(step_s * 1e9)

    async def completions(request: web.Request) -> web.StreamResponse:
        received_ns = time.monotonic_ns()
        body = await request.json()
        max_tokens, timing = int(body.get("max_tokens", 16)), bool(body.get("cadence_timing"))
        head = (
            b'data: {"id":"cmpl-ref","object":"text_completion","created":%d,"model":'
            % int(time.time())
            + json.dumps(body.get("model", "")).encode()
        )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        scheduled_ns = 0
        for i in range(max_tokens):
            tick = await ticker.wait()
            scheduled_ns = scheduled_ns or tick - step_ns
            finish = b'"length"' if i == max_tokens - 1 else b"null"
            event = (
                head + b',"choices":[{"index":0,"text":"a","logprobs":null,'
                b'"finish_reason":' + finish + b"}]"
            )
            if timing:
                event += (
                    b',"cadence":{"index":%d,"tokens":1,"timing":{"worker":0,'
                    b'"received_ns":%d,"scheduled_ns":%d,"step_start_ns":%d,'
                    b'"step_end_ns":%d,"front_recv_ns":%d,"send_ns":%d}}'
                    % (
                        i,
                        received_ns,
                        scheduled_ns,
                        tick - step_ns,
                        tick,
                        tick,
                        time.monotonic_ns(),
                    )
                )
            await response.write(event + b"}\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def serve(port: int, step_ms: float) -> None:
    runner = web.AppRunner(make_app(step_ms / 1e3), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=2048)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    # The banner cadence.lab.server_process reads (the HTTP port is the only port).
    print(f"cadence serving on 127.0.0.1:{bound} (http on 127.0.0.1:{bound})", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.step_ms))


if __name__ == "__main__":
    main()
