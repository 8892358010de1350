"""The front's link to a worker over real ipc sockets: one request's bad value cannot cost the
others sent in the same tick (issue 25)."""

from __future__ import annotations

import asyncio

import pytest

from cadence.transport.front_end import FrontChannel, encode_add
from cadence.transport.messages import AddRequest, WorkerInputs
from cadence.transport.sockets import local_addresses
from cadence.transport.worker_end import WorkerChannel


def test_a_request_msgpack_cannot_hold_fails_alone_and_its_batch_arrives() -> None:
    front = FrontChannel(*local_addresses(1, "ipc"))
    worker = WorkerChannel(front.input_addresses[0], front.output_address)
    try:
        async def send() -> None:
            (link,) = front.links(asyncio.get_running_loop())
            while not link.connected():  # an empty probe, until the worker's end is there
                await asyncio.sleep(0.01)
            link.add(encode_add(AddRequest(1, [1, 2], 3, seed=2 ** 64 - 1)))
            with pytest.raises(ValueError, match="64 bits"):
                encode_add(AddRequest(2, [1], 3, stop_token_ids=[2 ** 70]))
            link.add(encode_add(AddRequest(3, [4], 5, seed=-(2 ** 63))))
            link.abort(9)
            await asyncio.sleep(0)  # the tick ends: one flush

        asyncio.run(send())
        received = [m for m in worker.receive(2000) if m.adds or m.aborts]
        assert received == [WorkerInputs([AddRequest(1, [1, 2], 3, seed=2 ** 64 - 1),
                                          AddRequest(3, [4], 5, seed=-(2 ** 63))], [9])]
    finally:
        worker.close()
        front.close()
