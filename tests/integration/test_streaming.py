"""End to end: many concurrent streams through real worker processes, checked token by token."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from cadence.byte_tokenizer import ByteTokenizer
from cadence.client import AsyncClient, Client
from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import wait_until


async def _collect(client: AsyncClient, prompt: str, max_tokens: int, **options) -> list:
    return [chunk async for chunk in client.generate(prompt, max_tokens=max_tokens, **options)]


def _check_stream(chunks: list, max_tokens: int) -> list[int]:
    """Indexes are contiguous, only the last chunk finishes, and no token is lost or repeated."""
    tokens: list[int] = []
    for chunk in chunks:
        assert chunk.index == len(tokens), "a chunk's index must be its first token's position"
        tokens.extend(chunk.token_ids)
    assert [c.finish_reason for c in chunks[:-1]] == [0] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(tokens) == max_tokens
    assert "".join(c.text for c in chunks) == ByteTokenizer().decode(tokens)
    return tokens


def test_64_concurrent_streams_complete_with_every_token(server) -> None:
    async def run() -> list[list]:
        async with AsyncClient(server.target) as client:
            return await asyncio.gather(
                *(_collect(client, f"prompt {i % 8}", 60, request_id=f"r{i}") for i in range(64))
            )

    results = asyncio.run(run())
    by_prompt: dict[int, list[int]] = {}
    for i, chunks in enumerate(results):
        assert {c.request_id for c in chunks} == {f"r{i}"}
        tokens = _check_stream(chunks, 60)
        # Same prompt and seed, same tokens, whichever worker served it.
        assert by_prompt.setdefault(i % 8, tokens) == tokens
    assert len({tuple(t) for t in by_prompt.values()}) > 1


def test_sync_client_and_server_assigned_request_id(server) -> None:
    with Client(server.target) as client:
        chunks = list(client.generate("hello", max_tokens=5))
    _check_stream(chunks, 5)
    assert chunks[0].request_id and all(c.request_id == chunks[0].request_id for c in chunks)
    assert chunks[0].prompt_tokens == len("hello")


def test_timing_fields_follow_the_data_path(server) -> None:
    with Client(server.target) as client:
        chunks = list(client.generate("timed", max_tokens=4, include_timing=True))
    first = chunks[0].timing
    assert 0 < first.received_ns <= first.scheduled_ns <= first.step_start_ns
    for chunk in chunks:
        t = chunk.timing
        assert t.step_start_ns <= t.step_end_ns <= t.front_recv_ns <= t.send_ns


def test_a_timed_stream_carries_the_loop_lag_tally_of_its_start_and_its_end(server) -> None:
    # The start's tally goes out at the intake's next lull (or with the first chunk); it is
    # still the one taken when the stream opened, so it never counts more than the end's.
    # It goes out when it moved since a stream last carried it: a heartbeat (0.1 s) moves it,
    # so a stream opened after the next heartbeat carries it.
    tallies: list[tuple[str | None, str]] = []

    def carried_at_start() -> bool:
        with grpc.insecure_channel(server.target) as channel:
            call = pb_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(prompt="lag", max_tokens=4, include_timing=True), timeout=10
            )
            assert sum(len(chunk.token_ids) for chunk in call) == 4
            tallies.append(
                (
                    dict(call.initial_metadata()).get("cadence-loop-lag"),
                    dict(call.trailing_metadata())["cadence-loop-lag"],
                )
            )
        return tallies[-1][0] is not None

    wait_until(carried_at_start, 10, "no stream carried the start's tally")
    start, end = tallies[-1]
    (front, samples, counts), (end_front, end_samples, end_counts) = (
        tally.split(":") for tally in (start, end)
    )
    assert front == end_front == "0"
    assert 0 <= int(samples) <= int(end_samples)
    assert sum(map(int, counts.split(","))) == int(samples)
    assert sum(map(int, end_counts.split(","))) == int(end_samples)


def test_a_burst_of_timed_streams_carries_the_start_tally_once_each_end_tally_always(
    server,
) -> None:
    # One gRPC operation for the start's tally per burst, not per call: it goes out only
    # when it moved since a stream last carried it (every 0.1 s at most, by the heartbeat).
    bursts: list[tuple[list, list]] = []

    def burst_carried_it() -> bool:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            calls = [
                stub.Generate(
                    pb.GenerateRequest(prompt="lag", max_tokens=2, include_timing=True), timeout=10
                )
                for _ in range(16)
            ]
            for call in calls:
                assert sum(len(chunk.token_ids) for chunk in call) == 2
            bursts.append(
                (
                    [dict(c.initial_metadata()).get("cadence-loop-lag") for c in calls],
                    [dict(c.trailing_metadata()).get("cadence-loop-lag") for c in calls],
                )
            )
        return any(start is not None for start in bursts[-1][0])

    wait_until(burst_carried_it, 10, "no stream of a burst carried the start's tally")
    starts, ends = bursts[-1]
    assert all(ends)
    assert 1 <= sum(start is not None for start in starts) < len(starts) // 2


def test_stop_token_ends_stream_with_stop(server) -> None:
    with Client(server.target) as client:
        first = next(iter(client.generate("stop here", max_tokens=3)))
        stop = first.token_ids[0]
        chunks = list(client.generate("stop here", max_tokens=50, stop_token_ids=[stop]))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    assert [t for c in chunks for t in c.token_ids] == [stop]


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"prompt": "", "max_tokens": 4}, "prompt is empty"),
        ({"prompt": "x", "max_tokens": 10**6}, "--max-tokens-limit"),
        ({"prompt": [1, 300], "max_tokens": 4}, "prompt_token_ids must be in [0, 256)"),
        ({"prompt": [-1], "max_tokens": 4}, "must not be negative"),
        ({"prompt": "x", "max_tokens": 4, "temperature": -1.0}, "temperature"),
        # Echoed on every chunk: 3 MB of id made a 1.5 GB stream.
        (
            {"prompt": "x", "max_tokens": 4, "request_id": "i" * 257},
            "request_id is 257 bytes long; at most 256",
        ),
        (
            {"prompt": "x", "max_tokens": 4, "request_id": "é" * 129},
            "request_id is 258 bytes long; at most 256",
        ),
    ],
)
def test_bad_requests_get_invalid_argument(server, options, needle) -> None:
    prompt = options.pop("prompt")
    with Client(server.target) as client, pytest.raises(grpc.RpcError) as info:
        list(client.generate(prompt, **options))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


def test_a_request_id_at_the_limit_is_echoed_on_every_chunk(server) -> None:
    request_id = "k" * 256
    with Client(server.target) as client:
        chunks = list(client.generate("x", max_tokens=4, request_id=request_id))
    assert {c.request_id for c in chunks} == {request_id}


def test_an_idle_connection_is_closed_after_the_idle_connection_timeout() -> None:
    """--idle-connection-timeout on every port: a gRPC connection (grpc.aio or Envoy) that has
    spoken HTTP/2 and opened no call, one that never finishes its preface, and an HTTP
    connection that sends nothing are each closed by the server (Envoy kept them an hour)."""
    import socket
    import time

    import h2.config
    import h2.connection

    from tests.integration.conftest import start_server

    def closed_within(address: tuple[str, int], hello: bytes, limit: float) -> float:
        started = time.monotonic()
        with socket.create_connection(address, timeout=limit) as sock:
            sock.sendall(hello)
            try:
                while sock.recv(65536):  # the server's SETTINGS, then its GOAWAY
                    pass
            except TimeoutError:
                return limit
            except ConnectionResetError:
                pass
        return time.monotonic() - started

    preface = h2.connection.H2Connection(h2.config.H2Configuration())
    preface.initiate_connection()
    with start_server("--devices", "cpu:1", "--idle-connection-timeout", "1", http=True) as server:
        grpc_address = server.target.rsplit(":", 1)
        http_address = server.base.split("//")[1].rsplit(":", 1)
        limit = 30.0  # generous: the setting is 1 s; the default would be 60 s (Envoy: 1 h)
        for address, hello in (
            (grpc_address, preface.data_to_send()),
            (grpc_address, b""),
            (http_address, b""),
        ):
            waited = closed_within((address[0], int(address[1])), hello, limit)
            assert waited < limit, f"{address} {hello!r} still open after {limit:g} s"
        # Calls still work: a client's channel reconnects.
        with Client(server.target) as client:
            assert len(client.complete("x", max_tokens=3)) == 3


def test_health_and_reflection_on_the_same_port(server) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with Client(server.target) as client:
        assert client.health() == "SERVING"
        assert client.health("cadence.v1.Inference") == "SERVING"
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(stub.ServerReflectionInfo(iter([request])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"cadence.v1.Inference", "grpc.health.v1.Health"} <= names


def test_generate_command_streams_text(server) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "generate",
            "--target",
            server.target,
            "--max-tokens",
            "12",
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    with Client(server.target) as client:
        expected = client.complete("hello", max_tokens=12)
    assert out.stdout == expected + "\n"
