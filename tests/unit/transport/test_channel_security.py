"""The tcp transport's sockets answer only peers that were given the front's CURVE key."""

from __future__ import annotations

import msgspec
import zmq

from cadence.config import EngineConfig, WorkerSpec
from cadence.transport.front_channel import FrontChannel
from cadence.transport.messages import Heartbeat
from cadence.transport.sockets import local_addresses
from cadence.transport.worker_channel import WorkerChannel


def _spec(channel: FrontChannel, **keys: str) -> WorkerSpec:
    return WorkerSpec(
        index=0,
        device="cpu",
        input_address=channel.input_addresses[0],
        output_address=channel.output_address,
        engine=EngineConfig(),
        heartbeat_address=channel.heartbeat_address,
        **keys,
    )


def _received(channel: FrontChannel, timeout_ms: int = 500) -> list:
    got = []
    while channel._output.poll(timeout_ms):
        got.append(msgspec.msgpack.decode(channel._output.recv()))
        timeout_ms = 50
    return got


def test_a_worker_with_the_key_is_heard_and_an_outsider_is_not() -> None:
    front = FrontChannel(*local_addresses(1, "tcp"), secure=True)
    context = zmq.Context()
    try:
        _outsider_and_worker(front, context)
    finally:  # a failed check must not leave sockets that hold the interpreter at exit
        context.destroy(linger=0)
        front.close()


def _outsider_and_worker(front: FrontChannel, context: zmq.Context) -> None:
    assert front.curve_server_key and front.output_address.startswith("tcp://127.0.0.1:")
    outsider = context.socket(zmq.PUSH)
    outsider.setsockopt(zmq.LINGER, 0)
    outsider.connect(front.output_address)
    outsider.send(msgspec.msgpack.encode(Heartbeat(0)))
    listener = context.socket(zmq.SUB)  # nor can an outsider read the front's heartbeat
    listener.setsockopt(zmq.SUBSCRIBE, b"")
    listener.connect(front.heartbeat_address)
    assert _received(front) == []

    public, secret = front.curve_client_keys
    worker = WorkerChannel(
        front.input_addresses[0],
        front.output_address,
        curve=_spec(
            front,
            curve_server_key=front.curve_server_key,
            curve_public_key=public,
            curve_secret_key=secret,
        ),
    )
    worker.send(Heartbeat(0))
    assert _received(front) == [["beat", 0, 0, 0]]
    front.beat()
    assert not listener.poll(300)
    worker.close()


def test_a_worker_with_a_wrong_key_is_not_heard() -> None:
    front = FrontChannel(*local_addresses(1, "tcp"), secure=True)
    public, secret = (k.decode() for k in zmq.curve_keypair())
    other_server, _ = zmq.curve_keypair()
    worker = WorkerChannel(
        front.input_addresses[0],
        front.output_address,
        curve=_spec(
            front,
            curve_server_key=other_server.decode(),
            curve_public_key=public,
            curve_secret_key=secret,
        ),
    )
    worker.send(Heartbeat(0))
    assert _received(front) == []
    worker.close()
    front.close()
