"""Slow and stalled clients, overload and bad input, on real servers.

A test client that stops reading fills gRPC's flow-control window first; these clients use a
small window (`grpc.http2.lookahead_bytes`) so the server's per-request buffer is reached fast.
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cadence.client import Client, build_request
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import runs_once, start_server, wait_until
from tests.integration.raw_h2 import framed, h2_call

_SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _tokens(chunks) -> list[int]:
    out: list[int] = []
    for chunk in chunks:
        assert chunk.index == len(out)
        out.extend(chunk.token_ids)
    return out


@runs_once
@pytest.mark.parametrize("policy", ["block", "merge"])
def test_a_slow_reader_never_stalls_the_batch_and_loses_nothing(policy) -> None:
    args = ("--step-ms", "2", "--overflow", policy, "--queue-capacity", "8", "--metrics-port", "0")
    with start_server(*args) as server:
        url = server.metrics_url
        slow_channel = grpc.insecure_channel(server.target, options=_SMALL_WINDOW)
        slow = pb_grpc.InferenceStub(slow_channel).Generate(build_request("slow", max_tokens=600))
        first = next(slow)
        # The slow client reads nothing; its buffer reaches the queue capacity...
        wait_until(lambda: _metric(url, "cadence_deepest_buffer_steps") >= 8)
        # ...while a fast client on the same worker streams at the engine's pace.
        with Client(server.target) as client:
            fast = list(client.generate("fast", max_tokens=200))
        assert _tokens(fast) and fast[-1].finish_reason == pb.FINISH_REASON_LENGTH
        depth = _metric(url, "cadence_deepest_buffer_steps")
        if policy == "block":
            # The sequence is paused in the engine: its buffer stays near the capacity.
            assert depth <= 8 + 16
            # ...and the pause is counted as it happens, not when the stream ends.
            assert _metric(url, "cadence_sequence_pauses_total") >= 1
            assert _metric(url, "cadence_paused_sequences") == 1
        else:
            # Merge keeps taking its tokens: they wait here, to go out as larger chunks.
            assert depth > 8 + 16
        rest = list(slow)
        tokens = _tokens([first, *rest])
        assert len(tokens) == 600 and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert _metric(url, "cadence_buffer_overflows_total") > 0
        # Once the slow client has read everything no sequence is left paused.
        assert _metric(url, "cadence_paused_sequences") == 0
        if policy == "block":
            assert _metric(url, "cadence_sequence_pauses_total") >= 1
        else:
            assert _metric(url, "cadence_sequence_pauses_total") == 0
        slow_channel.close()


@runs_once
def test_a_worker_whose_only_stream_is_paused_is_not_hung() -> None:
    """Under the block policy a worker whose every sequence is paused has nothing to step:
    a client that stops reading for longer than --worker-timeout costs no worker."""
    args = (
        "--devices",
        "cpu:1",
        "--step-ms",
        "2",
        "--overflow",
        "block",
        "--queue-capacity",
        "8",
        "--worker-timeout",
        "1",
        "--metrics-port",
        "0",
    )
    with start_server(*args) as server:
        url = server.metrics_url
        channel = grpc.insecure_channel(server.target, options=_SMALL_WINDOW)
        slow = pb_grpc.InferenceStub(channel).Generate(build_request("slow", max_tokens=1000))
        first = next(slow)
        wait_until(lambda: _metric(url, "cadence_paused_sequences") == 1)
        time.sleep(2.5)  # paused for more than twice the worker timeout
        rest = list(slow)
        assert len(_tokens([first, *rest])) == 1000
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert _metric(url, "cadence_worker_restarts_total") == 0
        channel.close()


@runs_once
def test_abort_policy_ends_a_slow_stream_with_resource_exhausted() -> None:
    with start_server(
        "--step-ms", "2", "--overflow", "abort", "--queue-capacity", "8", "--metrics-port", "0"
    ) as server:
        channel = grpc.insecure_channel(server.target, options=_SMALL_WINDOW)
        call = pb_grpc.InferenceStub(channel).Generate(build_request("slow", max_tokens=5000))
        next(call)
        # The window and then the buffer fill (in any order of events): the buffer overflowed.
        wait_until(
            lambda: _metric(server.metrics_url, "cadence_buffer_overflows_total") > 0,
            15,
            "the stream's buffer never overflowed",
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--queue-capacity" in info.value.details()
        channel.close()


@runs_once
@pytest.mark.parametrize("step_ms", ["2", "20"])
def test_a_stalled_client_is_cut_off_and_its_slot_freed(step_ms) -> None:
    """grpc.aio: once the client's window is full the write waits, and --stall-timeout cuts
    the stream off (Envoy's path: test_native_grpc)."""
    args = ("--step-ms", step_ms, "--stall-timeout", "1", "--max-concurrent", "1")
    with start_server(*args) as server:
        channel = grpc.insecure_channel(server.target, options=_SMALL_WINDOW)
        stalled = pb_grpc.InferenceStub(channel).Generate(
            build_request("stall", max_tokens=10000), timeout=60
        )
        next(stalled)
        with Client(server.target) as client:
            deadline = time.monotonic() + 15
            while True:  # admitted once the stalled stream has been cut off
                try:
                    chunks = list(client.generate("next", max_tokens=3))
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.monotonic() < deadline, "the stalled stream kept its slot"
                    time.sleep(0.2)
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        # Reading again, the stalled client gets what was sent, then its status, not a wait
        # for its deadline (grpc.aio ends a cancelled handler's call with no status).
        with pytest.raises(grpc.RpcError) as cut:
            for _ in stalled:
                pass
        assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--stall-timeout" in cut.value.details()
        channel.close()


@runs_once
def test_overload_refuses_the_excess_at_once_and_serves_the_rest() -> None:
    with start_server("--devices", "cpu:2", "--step-ms", "10", "--max-concurrent", "8") as server:

        async def run() -> list:
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = pb_grpc.InferenceStub(channel)

                async def one(i: int):
                    t0 = time.monotonic()
                    try:
                        chunks = [
                            c async for c in stub.Generate(build_request(f"o{i}", max_tokens=40))
                        ]
                        return "OK", len(_tokens(chunks)), time.monotonic() - t0
                    except grpc.aio.AioRpcError as exc:
                        return exc.code().name, 0, time.monotonic() - t0

                return await asyncio.gather(*(one(i) for i in range(80)))

        results = asyncio.run(run())
    ok = [r for r in results if r[0] == "OK"]
    refused = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(refused) == 80
    assert 8 <= len(ok) < 80 and all(n == 40 for _, n, _ in ok)
    # Refused at once: well before an admitted stream could have finished (40 x 10 ms).
    assert max(t for _, _, t in refused) < min(t for _, _, t in ok)


@pytest.mark.slow
@runs_once
def test_a_burst_of_2000_calls_on_one_connection_is_served_or_refused_never_dropped() -> None:
    """2,000 calls at once on one HTTP/2 connection, more than --max-concurrent: each is served
    or refused RESOURCE_EXHAUSTED by cadence's admission. gRPC's core drops calls it holds
    unasked past its pending limit (1,000, at random up to 3,000) as CANCELLED, which no client
    can tell from its own cancel (issue 35)."""
    with start_server("--devices", "cpu:1", "--step-ms", "5", "--max-concurrent", "512") as server:

        async def burst() -> collections.Counter:
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = pb_grpc.InferenceStub(channel)

                async def one(i: int) -> tuple[str, str]:
                    try:
                        async for _ in stub.Generate(
                            build_request(f"b{i}", max_tokens=200), timeout=60
                        ):
                            pass
                        return "OK", ""
                    except grpc.aio.AioRpcError as exc:
                        return exc.code().name, exc.details()

                return collections.Counter(await asyncio.gather(*(one(i) for i in range(2000))))

        for _ in range(2):
            ends = asyncio.run(burst())
            codes = collections.Counter()
            for (code, details), n in ends.items():
                codes[code] += n
                if code == "RESOURCE_EXHAUSTED":
                    assert "--max-concurrent" in details
            assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, ends
            assert codes["OK"] >= 512


def _raw_generate(target: str, payload: bytes) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream(
            "/cadence.v1.Inference/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateChunk.FromString,
        )
        try:
            list(call(payload, timeout=10))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""


@runs_once
def test_malformed_duplicate_and_oversized_requests() -> None:
    with start_server("--step-ms", "5", "--max-message-bytes", "65536") as server:
        valid = pb.GenerateRequest(prompt="ab", max_tokens=2).SerializeToString()
        code, details = _raw_generate(server.target, valid.replace(b"ab", b"\xff\xfe"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in details
        code, details = _raw_generate(server.target, b"\x0a\xff\xff\xff")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in details
        code, details = _raw_generate(
            server.target,
            pb.GenerateRequest(prompt="x" * 100_000, max_tokens=1).SerializeToString(),
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with Client(server.target) as client:
            first = client.generate("dup", max_tokens=1000, request_id="same")
            next(first)
            with pytest.raises(grpc.RpcError) as info:
                list(client.generate("dup", max_tokens=5, request_id="same"))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "already streaming" in info.value.details()
            first.close()
            assert _tokens(list(client.generate("ok", max_tokens=5, request_id="other")))


@runs_once
def test_a_request_body_empty_or_cut_short_is_answered() -> None:
    """A call whose request stream ends with no whole message gets a status at once: grpcio's
    path for a unary request ends it with none, and the client waits for its deadline. Beside
    it, a `-bin` header that is not base64: INTERNAL, in grpcio's words, as on native."""
    with start_server("--step-ms", "5") as server:
        request = framed(pb.GenerateRequest(prompt="hi", max_tokens=2))
        for path, body in (
            ("/cadence.v1.Inference/Generate", request),
            (
                "/inference.GRPCInferenceService/ModelInfer",
                framed(kpb.ModelInferRequest(model_name="cadence")),
            ),
        ):
            for cut in (b"", body[:-3], body[:2]):
                started = time.monotonic()
                got = h2_call(server.target, path, [], cut, timeout=5)
                assert got.get(b"grpc-status") == b"13", (path, cut, got)
                assert b"expected one request message" in got[b"grpc-message"]
                assert time.monotonic() - started < 2
        got = h2_call(
            server.target, "/cadence.v1.Inference/Generate", [(b"x-trace-bin", b"abcde")], request
        )
        assert got.get(b"grpc-status") == b"13", got
        assert got[b"grpc-message"] == (
            b"Error parsing 'x-trace-bin' metadata: illegal base64 encoding"
        )
        assert (
            h2_call(server.target, "/cadence.v1.Inference/Generate", [], request).get(
                b"grpc-status"
            )
            == b"0"
        )


def test_health_and_reflection_answer_bytes_that_do_not_parse_and_log_nothing() -> None:
    """Health needs no token: if bytes that do not parse cost a traceback in the log, any client
    can flood it. Each such call ends INTERNAL (as grpc-go and grpc-java answer), an empty body
    too, and nothing is logged."""
    server = start_server("--step-ms", "5", stderr=subprocess.PIPE)
    try:
        for path in (
            "/grpc.health.v1.Health/Check",
            "/grpc.health.v1.Health/Watch",
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ):
            for _ in range(3):
                got = h2_call(server.target, path, [], b"\0\0\0\0\3\xff\xff\xff")
                assert got.get(b"grpc-status") == b"13", (path, got)
                assert got[b"grpc-message"].startswith(b"could not parse the request message")
        got = h2_call(server.target, "/grpc.health.v1.Health/Check", [], b"")
        assert got.get(b"grpc-status") == b"13", got
        assert b"expected one request message" in got[b"grpc-message"]
        with Client(server.target) as client:  # and well-formed calls are served as before
            assert client.health() == "SERVING"
        with grpc.insecure_channel(server.target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
    finally:
        server.stop()
    log = server.process.stderr.read()
    assert "Traceback" not in log and "DecodeError" not in log, log[-3000:]


@runs_once
def test_output_counters_move_while_a_stream_runs() -> None:
    """Tokens and chunks are counted as they are sent, not when the stream ends, so a
    scrape during a long stream sees its progress."""
    with start_server("--step-ms", "5", "--metrics-port", "0") as server:
        url = server.metrics_url
        channel = grpc.insecure_channel(server.target)
        call = pb_grpc.InferenceStub(channel).Generate(build_request("long", max_tokens=10_000))
        received = 0
        for chunk in call:
            received += len(chunk.token_ids)
            if received >= 50:
                break
        tokens = _metric(url, "cadence_output_tokens_total")
        chunks = _metric(url, "cadence_chunks_total")
        assert tokens >= 50 and chunks >= 1, (tokens, chunks)
        assert _metric(url, "cadence_requests_total") == 0  # still streaming
        call.cancel()
        channel.close()
