"""`cadence serve --fronts 2`: two front processes on one port, each connected to every worker."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import grpc
import psutil
import pytest

from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import (
    SERVE_ARGS,
    free_port,
    live_workers,
    runs_once,
    wait_until_async,
)

_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""A channel of its own: a new TCP connection, which the kernel gives to either front."""


class _Stream:
    """One Generate call on its own connection; `front` and `pid` come from its metadata."""

    def __init__(self, target: str, max_tokens: int) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=_OWN_CONNECTION)
        stub = pb_grpc.InferenceStub(self.channel)
        self.call = stub.Generate(pb.GenerateRequest(prompt="the fronts", max_tokens=max_tokens))
        self.max_tokens = max_tokens
        self.front = self.pid = None

    async def opened(self) -> _Stream:
        metadata = dict(await self.call.initial_metadata())
        self.front = int(metadata["cadence-front"])
        self.pid = int(metadata["cadence-front-pid"])
        return self

    async def read_all(self) -> tuple[str, list]:
        """(status name, chunks) once the call ends."""
        chunks = []
        try:
            async for chunk in self.call:
                chunks.append(chunk)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, chunks
        return "OK", chunks

    async def close(self) -> None:
        await self.channel.close()


async def _open(target: str, max_tokens: int) -> _Stream:
    return await _Stream(target, max_tokens).opened()


def _whole(chunks: list, max_tokens: int) -> str:
    """Assert a stream has every token once, in order, and ended; return its text."""
    index = 0
    for chunk in chunks:
        assert chunk.index == index
        index += len(chunk.token_ids)
    assert index == max_tokens
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return "".join(c.text for c in chunks)


def test_connections_spread_over_both_fronts_and_every_stream_is_whole(server_factory) -> None:
    metrics_port = free_port()
    server = server_factory(
        "--fronts", "2", "--devices", "cpu:2", "--step-ms", "5", "--metrics-port", str(metrics_port)
    )

    async def run():
        streams = await asyncio.gather(*(_open(server.target, 30) for _ in range(24)))
        results = await asyncio.gather(*(s.read_all() for s in streams))
        for s in streams:
            await s.close()
        return streams, results

    streams, results = asyncio.run(run())
    assert {s.front for s in streams} == {0, 1}, "every connection landed on one front"
    assert len({s.pid for s in streams}) == 2
    texts = set()
    for status, chunks in results:
        assert status == "OK"
        texts.add(_whole(chunks, 30))
    assert len(texts) == 1, "the same request gave different text on different fronts"

    # One endpoint shows every front's own counters, each sample labelled with its front.
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for front in (0, 1):
        expected = sum(1 for s in streams if s.front == front)
        line = (
            f'cadence_requests_total{{code="OK",front="{front}",protocol="cadence.v1"}} '
            f"{float(expected)}"
        )
        assert line in text, (line, text[:2000])
    # The gateway's gauges describe the server: one series each, the fronts' counts summed.
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert [line for line in text.splitlines() if line.startswith(name + "{")] == [
            f'{name}{{model_name="cadence"}} 0.0'
        ]


def test_max_concurrent_is_global_and_cancel_frees_the_slot(server_factory) -> None:
    server = server_factory("--fronts", "2", "--max-concurrent", "4", "--step-ms", "20")

    async def run():
        held = [await _open(server.target, 5000) for _ in range(4)]
        refused = []
        for _ in range(8):  # new connections: each lands on either front
            extra = _Stream(server.target, 5)
            status, _ = await extra.read_all()
            refused.append(status)
            await extra.close()
        # Cancel one held stream: its slot is free again, whichever front it was on.
        held[0].call.cancel()
        await held[0].close()

        async def admitted() -> bool:
            extra = _Stream(server.target, 3)
            status, _ = await extra.read_all()
            await extra.close()
            return status == "OK"

        await wait_until_async(admitted, 10, "the cancelled stream kept its slot")
        statuses = []
        for _ in range(4):
            extra = _Stream(server.target, 3)
            status, chunks = await extra.read_all()
            statuses.append(status)
            if status == "OK":
                _whole(chunks, 3)
            await extra.close()
        for s in held[1:]:
            s.call.cancel()
            await s.close()
        return refused, statuses

    refused, statuses = asyncio.run(run())
    assert refused == ["RESOURCE_EXHAUSTED"] * 8, refused
    assert statuses == ["OK"] * 4, statuses


def test_killing_one_front_ends_only_its_streams(server_factory) -> None:
    server = server_factory(
        "--fronts", "2", "--devices", "cpu:2", "--step-ms", "10", "--max-concurrent", "12"
    )

    async def run():
        streams = []
        while len({s.front for s in streams}) < 2 or len(streams) < 6:
            assert len(streams) < 12, "no connection landed on the second front"
            streams.append(await _open(server.target, 150))
        readers = [asyncio.ensure_future(s.read_all()) for s in streams]
        await asyncio.sleep(0.3)
        victim = next(s.pid for s in streams if s.front == 1)
        assert victim != server.process.pid
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.gather(*readers)
        for s in streams:
            await s.close()
        # The other front keeps serving, and the dead front's slots were given back: as many
        # streams as --max-concurrent allows fit again.
        tries: list[tuple[list, list]] = []

        async def all_fit() -> bool:
            again = [_Stream(server.target, 20) for _ in range(12)]
            after = await asyncio.gather(*(s.read_all() for s in again))
            refused = any(status == "RESOURCE_EXHAUSTED" for status, _ in after)
            if not refused:
                await asyncio.gather(*(s.opened() for s in again))
            for s in again:
                await s.close()
            tries.append((again, after))
            return not refused  # else the dead front's slots are not back yet

        await wait_until_async(all_fit, 10, "the dead front's slots were not given back")
        again, after = tries[-1]
        return streams, results, again, after, victim

    streams, results, again, after, victim = asyncio.run(run())
    for s, (status, chunks) in zip(streams, results):
        if s.front == 1:
            assert status == "UNAVAILABLE", status
        else:
            assert status == "OK", status
            _whole(chunks, 150)
    # Served by front 0, or by front 1's replacement (restarted after a 1 s back-off), never
    # by the dead process.
    assert victim not in {s.pid for s in again}
    for status, chunks in after:
        assert status == "OK"
        _whole(chunks, 20)


def test_a_killed_front_is_restarted_and_counted(server_factory) -> None:
    metrics_port = free_port()
    server = server_factory(
        "--fronts", "2", "--devices", "cpu:2", "--step-ms", "5", "--metrics-port", str(metrics_port)
    )

    async def front_one() -> _Stream:
        for _ in range(40):  # new connections land on either front
            stream = await _open(server.target, 5)
            if stream.front == 1:
                return stream
            await stream.read_all()
            await stream.close()
        raise AssertionError("no connection landed on front 1")

    async def run():
        first = await front_one()
        await first.read_all()
        await first.close()
        os.kill(first.pid, signal.SIGKILL)
        deadline = asyncio.get_running_loop().time() + 30
        while True:  # until a new process serves as front 1 (after a 1 s back-off)
            assert asyncio.get_running_loop().time() < deadline, "front 1 was not restarted"
            await asyncio.sleep(0.2)
            try:
                stream = await asyncio.wait_for(front_one(), 10)
            except (AssertionError, KeyError, grpc.aio.AioRpcError, TimeoutError):
                # KeyError: a call refused before its metadata (the new front is starting)
                continue
            status, chunks = await stream.read_all()
            await stream.close()
            if stream.pid != first.pid:
                return first.pid, stream.pid, status, chunks

    dead, pid, status, chunks = asyncio.run(run())
    assert pid != dead and status == "OK"
    _whole(chunks, 5)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'cadence_front_restarts_total{front="1"} 1.0' in text, text[:3000]


def test_a_killed_worker_comes_back_for_every_front(server_factory) -> None:
    """The replacement hears front 0's heartbeat (not a child front's silent socket), stays
    up, and serves the streams of both fronts."""
    server = server_factory("--fronts", "2", "--devices", "cpu:2", "--step-ms", "5")
    victim = live_workers(server)[0]
    victim.kill()
    deadline = time.monotonic() + 20
    while (worker := live_workers(server).get(0)) is None or worker.pid == victim.pid:
        assert time.monotonic() < deadline, "worker 0 was not restarted"
        time.sleep(0.05)
    time.sleep(3.0)  # three heartbeat timeouts
    assert live_workers(server).get(0) == worker, "the replacement worker exited"

    async def run():
        streams = []
        for _ in range(24):
            stream = _Stream(server.target, 20)
            stream.call = pb_grpc.InferenceStub(stream.channel).Generate(
                pb.GenerateRequest(prompt="back", max_tokens=20, include_timing=True)
            )
            streams.append(await stream.opened())
        results = await asyncio.gather(*(s.read_all() for s in streams))
        for s in streams:
            await s.close()
        return streams, results

    streams, results = asyncio.run(run())
    served = set()
    for stream, (status, chunks) in zip(streams, results):
        assert status == "OK", status
        _whole(chunks, 20)
        served.add((stream.front, chunks[0].timing.worker))
    assert {worker for _, worker in served} == {0, 1}
    assert {front for front, _ in served} == {0, 1}


@pytest.mark.native
@runs_once  # native already
@pytest.mark.parametrize("victim", ["envoy", "its starter"])
def test_native_a_killed_child_front_is_back_within_seconds(server_factory, victim: str) -> None:
    """--grpc-server native: a child front is two processes, `front_child` (Python) and the
    Envoy it starts (which runs the front's Python). Whichever is killed with streams open,
    within seconds every new connection is served again, front 1's replacement included (the
    kernel gives it half of them): no Envoy left behind holds the port or the workers'
    connections to front 1's sockets, which the replacement needs."""
    pytest.importorskip("pyvoy", reason="pyvoy is in the test extras (cadence[native])")
    server = server_factory(
        "--fronts",
        "2",
        "--devices",
        "cpu:2",
        "--step-ms",
        "10",
        "--max-concurrent",
        "64",
        *(() if SERVE_ARGS else ("--grpc-server", "native")),
    )

    async def batch() -> list[tuple[str, int | None, int | None]]:
        """Eight calls, each on a new connection: (status, front, pid) of each."""

        async def one() -> tuple[str, int | None, int | None]:
            stream = _Stream(server.target, 3)
            try:
                status, _ = await asyncio.wait_for(stream.read_all(), 5.0)
                if status == "OK":
                    await stream.opened()
            except TimeoutError:
                status = "no answer in 5 s"
            await stream.close()
            return status, stream.front, stream.pid

        return await asyncio.gather(*(one() for _ in range(8)))

    async def run():
        streams = []
        while len({s.front for s in streams}) < 2 or len(streams) < 6:
            assert len(streams) < 12, "no connection landed on the second front"
            streams.append(await _open(server.target, 500))
        readers = [asyncio.ensure_future(s.read_all()) for s in streams]
        envoy = next(s.pid for s in streams if s.front == 1)
        pid = envoy if victim == "envoy" else psutil.Process(envoy).ppid()
        assert "cadence.lifecycle.front_child" in psutil.Process(pid).cmdline() or pid == envoy
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while True:  # every call of a batch served, front 1's replacement among them
            results = await batch()
            back = all(status == "OK" for status, _, _ in results) and any(
                front == 1 and pid != envoy for _, front, pid in results
            )
            if back:
                break
            assert time.monotonic() - killed < 15, f"not back 15 s after the kill: {results}"
            await asyncio.sleep(0.2)
        again = await batch()  # and it stays so
        for s in streams:
            await s.close()
        for reader in readers:
            reader.cancel()
        return again, envoy

    again, envoy = asyncio.run(run())
    assert all(status == "OK" for status, _, _ in again), again
    assert envoy not in {pid for _, _, pid in again}


def test_fronts_above_one_need_ipc() -> None:
    from cadence.config import ServerConfig

    with pytest.raises(ValueError, match="--transport ipc"):
        ServerConfig(fronts=2, transport="tcp")
    with pytest.raises(ValueError, match="fronts must be at least 1"):
        ServerConfig(fronts=0)
