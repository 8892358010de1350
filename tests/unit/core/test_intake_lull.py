"""IntakeLull: a wait ends at a lull in the intake of new requests, or sooner at the stream's
own output, and never ends a later wait of that stream (a real event loop, real streams)."""

from __future__ import annotations

import asyncio

from cadence.byte_tokenizer import ByteTokenizer
from cadence.core.intake_lull import IntakeLull
from cadence.core.metrics import StreamTally
from cadence.core.stream import RequestStream


def make_stream(seq_id: int) -> RequestStream:
    return RequestStream(
        seq_id,
        0,
        1,
        capacity=8,
        overflow="merge",
        include_timing=False,
        decoder=ByteTokenizer().stream_decoder(),
        received_ns=1,
        tally=StreamTally(),
    )


def test_the_wait_lasts_while_requests_keep_opening_and_ends_once_they_stop() -> None:
    async def run() -> tuple[int, int]:
        lull = IntakeLull()
        loop = asyncio.get_running_loop()
        opens = 2000

        def open_one() -> None:  # one request opened per loop tick, as in a burst
            lull.opened += 1
            if lull.opened < opens:
                loop.call_soon(open_one)

        lull.opened = 1
        loop.call_soon(open_one)
        await lull.wait(make_stream(1))
        return lull.opened, opens

    opened, opens = asyncio.run(run())
    assert opened == opens


def test_output_ends_the_wait_at_once_and_the_lull_never_ends_a_later_wait() -> None:
    async def run() -> None:
        lull = IntakeLull()
        early, other = make_stream(1), make_stream(2)
        lull.opened = 2
        waiting = asyncio.ensure_future(lull.wait(early))
        other_waiting = asyncio.ensure_future(lull.wait(other))
        await asyncio.sleep(0)
        early.push([65], None, 1, 2, 3)  # its first chunk came before any lull
        await waiting
        assert not other_waiting.done()
        early.take_chunk()
        next_chunk = asyncio.ensure_future(early.wait())
        await other_waiting  # the lull
        await asyncio.sleep(0)
        assert not next_chunk.done()
        early.push([66], None, 4, 5, 6)
        await next_chunk

    asyncio.run(run())
