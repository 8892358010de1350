"""The front's link to a worker over real ipc sockets: a tick's requests go out as one message
per worker, and one request's bad value cannot cost the others sent in the same tick (issue 25)."""

from __future__ import annotations

import asyncio
import os

import pytest

from cadence.config import ServerConfig
from cadence.core.generation import FrontCore
from cadence.core.metrics import CADENCE_V1, FrontMetrics
from cadence.core.requests import Request
from cadence.router import WorkerRouter
from cadence.transport.front_channel import FrontChannel, encode_add
from cadence.transport.messages import WorkerInputs
from cadence.transport.sockets import local_addresses
from cadence.transport.worker_channel import WorkerChannel
from cadence.vocabulary import AddRequest, Sampling


def adds_received(worker: WorkerChannel) -> list[WorkerInputs]:
    """The messages with requests or aborts that reach `worker` until none has come for a
    moment (the empty probes of `connected` may arrive first)."""
    messages: list[WorkerInputs] = []
    while batch := worker.receive(50 if messages else 2000):
        messages += [m for m in batch if m.adds or m.aborts]
    return messages


def test_a_request_msgpack_cannot_hold_fails_alone_and_its_batch_arrives() -> None:
    front = FrontChannel(*local_addresses(1, "ipc"))
    worker = WorkerChannel(front.input_addresses[0], front.output_address)
    try:

        async def send() -> None:
            (link,) = front.links(asyncio.get_running_loop())
            while not link.connected():  # an empty probe, until the worker's end is there
                await asyncio.sleep(0.01)
            link.add(encode_add(AddRequest(1, [1, 2], 3, Sampling(seed=2**64 - 1))))
            with pytest.raises(ValueError, match="64 bits"):
                encode_add(AddRequest(2, [1], 3, Sampling(stop_token_ids=(2**70,))))
            link.add(encode_add(AddRequest(3, [4], 5, Sampling(seed=-(2**63)))))
            link.abort(9)
            await asyncio.sleep(0)  # the tick ends: one flush

        asyncio.run(send())
        received = adds_received(worker)
        assert received == [
            WorkerInputs(
                [
                    AddRequest(1, [1, 2], 3, Sampling(seed=2**64 - 1)),
                    AddRequest(3, [4], 5, Sampling(seed=-(2**63))),
                ],
                [9],
            )
        ]
    finally:
        worker.close()
        front.close()


def test_a_burst_opened_in_one_tick_reaches_each_worker_as_one_message() -> None:
    # Calls taken in during one event-loop tick are admitted and routed one by one, but sent
    # as a batch: each worker gets one message with its share, not one message per call.
    front = FrontChannel(*local_addresses(2, "ipc"))
    workers = [WorkerChannel(address, front.output_address) for address in front.input_addresses]
    try:

        async def burst() -> list[list[WorkerInputs]]:
            links = front.links(asyncio.get_running_loop())
            while not all(link.connected() for link in links):
                await asyncio.sleep(0.01)
            core = FrontCore(
                ServerConfig(max_concurrent=64), links, WorkerRouter(2), FrontMetrics()
            )
            core.refusal = None
            generations = [
                core.open(
                    Request(prompt=f"call {i}", max_tokens=3), 1, lambda: None, protocol=CADENCE_V1
                )
                for i in range(64)
            ]
            await asyncio.sleep(0)  # the tick ends
            received = [adds_received(worker) for worker in workers]
            for generation in generations:
                generation.close()
            return received

        received = asyncio.run(burst())
        assert [[len(m.adds) for m in messages] for messages in received] == [[32], [32]]
        seq_ids = sorted(add.seq_id for messages in received for add in messages[0].adds)
        assert seq_ids == list(range(1, 65))
    finally:
        for worker in workers:
            worker.close()
        front.close()


def test_a_front_channel_closed_late_leaves_its_replacements_socket_files(tmp_path) -> None:
    """`--fronts N`: a restarted front binds its predecessor's paths; the predecessor's clean-up,
    should it come afterwards, removes nothing of the replacement's (its workers could not
    reconnect), and a channel's own files still go."""
    from cadence.transport.sockets import front_addresses

    old = FrontChannel(*front_addresses(str(tmp_path), 1, 2))
    new = FrontChannel(*front_addresses(str(tmp_path), 1, 2))  # binds over the same paths
    paths = [
        a[len("ipc://") :]
        for a in (*new.input_addresses, new.output_address, new.heartbeat_address)
    ]
    assert len(paths) == 4 and all(map(os.path.exists, paths))
    old.close()
    assert all(map(os.path.exists, paths)), "the old channel removed its replacement's sockets"
    new.close()
    assert not any(map(os.path.exists, paths))
