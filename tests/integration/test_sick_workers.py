"""Supervision for every front and every kind of sickness, over real `cadence serve` processes:
a worker whose every step fails (a sticky device error) is taken out of routing and restarted,
and a hung worker is caught by `--worker-timeout` whichever front its requests came through."""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import runs_once, start_server

MODELS = "tests.batched_models"
_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""A channel of its own: a new TCP connection, which the kernel gives to either front."""


pytestmark = pytest.mark.usefixtures("importable_models")


def _sample(url: str, name: str, worker: int) -> float:
    """The value of `name{...worker="N"...}` on the metrics page (0 when absent)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.search(rf'^{name}{{[^}}]*worker="{worker}"[^}}]*}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def _outcome(call) -> tuple[str, list]:
    """(status name, chunks) once `call` ends."""
    chunks = []
    try:
        async for chunk in call:
            chunks.append(chunk)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, chunks
    return "OK", chunks


async def _count(stub: pb_grpc.InferenceStub) -> tuple[str, list]:
    """One request of 10 tokens: (status name, chunks)."""
    return await _outcome(
        stub.Generate(
            pb.GenerateRequest(prompt="count 10", max_tokens=10, include_timing=True), timeout=30
        )
    )


async def _health(channel: grpc.aio.Channel, service: str) -> str:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10
    )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@runs_once  # the workers' supervision: no part of the gRPC server's
@pytest.mark.parametrize("fronts", [1, 2])
def test_a_worker_whose_every_step_fails_is_taken_out_and_restarted(tmp_path, fronts) -> None:
    """Worker 1's steps all raise: after `--worker-max-failed-steps` (5) of them it is ejected
    (counted, NOT_SERVING, routed around), so nearly every request succeeds, and its
    replacement (a healthy card) serves again. With `--fronts 2` the requests go through
    front 1, which routes around it too, while front 0 restarts it."""
    env = {
        **os.environ,
        "SICK_MODEL_WORKER": "1",
        "SICK_MODEL_MARKER": str(tmp_path / "was-sick"),
    }
    server = start_server(
        "--engine",
        f"{MODELS}:SickModel",
        "--devices",
        "cpu:2",
        "--fronts",
        str(fronts),
        "--metrics-port",
        "0",
        env=env,
    )
    try:

        async def run() -> None:
            channel = await _channel_on_front(server.target, fronts - 1)
            stub = pb_grpc.InferenceStub(channel)
            # The sick worker takes its share of the traffic (its requests fail at once)
            # until it is taken out.
            deadline = time.monotonic() + 30
            while not _sample(server.metrics_url, "cadence_worker_ejections_total", 1):
                assert time.monotonic() < deadline, "the sick worker was never taken out"
                await asyncio.gather(*(_count(stub) for _ in range(4)))
            # Then nearly every request succeeds, 4 at a time.
            results = []
            for _ in range(10):
                results += await asyncio.gather(*(_count(stub) for _ in range(4)))
            ok = [chunks for code, chunks in results if code == "OK"]
            assert len(ok) >= 36, [code for code, _ in results]
            assert all("".join(c.text for c in chunks) == "0123456789" for chunks in ok)
            # Its replacement was started, reported ready, and serves.
            deadline = time.monotonic() + 60
            while True:
                assert time.monotonic() < deadline, "worker 1's replacement never served"
                if (
                    _sample(server.metrics_url, "cadence_worker_restarts_total", 1) >= 1
                    and await _health(channel, "cadence.worker.1") == "SERVING"
                ):
                    code, chunks = await _count(stub)
                    if code == "OK" and chunks[-1].timing.worker == 1:
                        break
                await asyncio.sleep(0.2)
            await channel.close()

        asyncio.run(run())
    finally:
        assert server.stop() == 0


async def _channel_on_front(target: str, front: int) -> grpc.aio.Channel:
    """A channel whose connection landed on `front` (the kernel spreads new connections)."""
    for _ in range(60):
        channel = grpc.aio.insecure_channel(target, options=_OWN_CONNECTION)
        call = pb_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(prompt="count 1", max_tokens=1), timeout=30
        )
        landed = int(dict(await call.initial_metadata()).get("cadence-front", 0))
        # Any answer will do: the probe only learns its front (it may meet the sick worker).
        code, _ = await _outcome(call)
        assert code in ("OK", "INTERNAL", "UNAVAILABLE"), code
        if landed == front:
            return channel
        await channel.close()
    raise AssertionError(f"no connection landed on front {front}")


def test_a_worker_hung_on_a_child_fronts_request_is_caught(server_factory) -> None:
    """`--fronts 2`: a step that never returns, for a request that came through front 1 (front
    0, which owns the workers, has none open), is caught by `--worker-timeout`: the worker is
    killed and restarted, and the stream ends UNAVAILABLE, not at its deadline."""
    server = server_factory(
        "--engine",
        f"{MODELS}:EchoModel",
        "--fronts",
        "2",
        "--worker-timeout",
        "3",
        "--metrics-port",
        "0",
    )

    async def run() -> None:
        channel = await _channel_on_front(server.target, 1)
        stub = pb_grpc.InferenceStub(channel)
        started = time.monotonic()
        code, chunks = await _outcome(
            stub.Generate(pb.GenerateRequest(prompt="hang", max_tokens=50), timeout=40)
        )
        took = time.monotonic() - started
        assert code == "UNAVAILABLE", (code, took)
        assert len(chunks) >= 1  # its first outputs came before the hang
        assert took < 25, f"the hang was caught after {took:.1f} s (--worker-timeout 3)"
        # The replacement serves front 1's requests.
        deadline = time.monotonic() + 60
        while True:
            code, chunks = await _outcome(
                stub.Generate(pb.GenerateRequest(prompt="count 5", max_tokens=5), timeout=30)
            )
            if code == "OK":
                assert "".join(c.text for c in chunks) == "01234"
                break
            assert code == "UNAVAILABLE" and time.monotonic() < deadline, code
            await asyncio.sleep(0.2)
        await channel.close()

    asyncio.run(run())
    assert _sample(server.metrics_url, "cadence_worker_restarts_total", 0) >= 1
