"""Property-based requests and raw bytes on the wire: the server answers every one with OK or
a clear INVALID_ARGUMENT, never crashes, and a stream running alongside is untouched."""

from __future__ import annotations

import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.client import Client
from cadence.proto.v1 import inference_pb2 as pb
from tests.integration.conftest import start_server

_ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def fuzz_server():
    # A small max_tokens limit keeps every accepted request short.
    with start_server(
        "--step-ms", "1", "--max-tokens-limit", "32", "--max-prompt-tokens", "512"
    ) as server:
        with Client(server.target) as client:
            done, streams, broken = threading.Event(), [], []

            def neighbour() -> None:
                # Streams that run the whole time the fuzzer sends: each must come whole.
                while not done.is_set():
                    chunks = list(client.generate("steady", max_tokens=32, timeout=60))
                    streams.append(chunks)
                    if sum(len(c.token_ids) for c in chunks) != 32:
                        broken.append(chunks)

            thread = threading.Thread(target=neighbour)
            thread.start()
            channel = grpc.insecure_channel(server.target)
            yield channel.unary_stream(
                "/cadence.v1.Inference/Generate",
                request_serializer=lambda b: b,
                response_deserializer=pb.GenerateChunk.FromString,
            )
            channel.close()
            done.set()
            thread.join(60)
            assert streams and not broken
            assert client.health() == "SERVING"


def _answer(call, payload: bytes) -> tuple[grpc.StatusCode, list]:
    try:
        chunks = list(call(payload, timeout=30))
    except grpc.RpcError as exc:
        return exc.code(), []
    return grpc.StatusCode.OK, chunks


def _whole(chunks: list) -> None:
    seen = 0
    for chunk in chunks:
        assert chunk.index == seen
        seen += len(chunk.token_ids)
    assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


requests = st.builds(
    pb.GenerateRequest,
    request_id=st.text(max_size=12),
    prompt=st.text(max_size=64),
    max_tokens=st.integers(0, 2**32 - 1),
    prompt_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
    sampling=st.builds(
        pb.SamplingParams,
        temperature=st.floats(width=32),
        top_p=st.floats(width=32),
        top_k=st.integers(0, 2**32 - 1),
        seed=st.integers(0, 2**64 - 1),
    ),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4),
    include_timing=st.booleans(),
)


@_SETTINGS
@given(request=requests)
def test_any_request_gets_ok_or_invalid_argument(fuzz_server, request) -> None:
    code, chunks = _answer(fuzz_server, request.SerializeToString())
    assert code in _ANSWERS
    if code == grpc.StatusCode.OK:
        _whole(chunks)


@_SETTINGS
@given(payload=st.binary(max_size=256))
def test_any_bytes_get_ok_or_invalid_argument(fuzz_server, payload) -> None:
    code, chunks = _answer(fuzz_server, payload)
    assert code in _ANSWERS
    if code == grpc.StatusCode.OK:
        _whole(chunks)
