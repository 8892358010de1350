"""The Open Inference Protocol (KServe v2 / Triton gRPC) on real `cadence serve` processes,
driven by Triton's own client, tritonclient."""

from __future__ import annotations

import queue
import threading
import time
import urllib.request

import grpc
import msgspec
import pytest

from cadence.client import Client
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.kserve import KServeTarget
from cadence.lab.load.plan import RequestShape
from tests.integration.conftest import runs_once, start_server

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient is in the test extras")
np = pytest.importorskip("numpy")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException

MODEL = "cadence"


def _inputs(
    prompt_ids: list[int] | None = None,
    max_tokens: int = 8,
    *,
    prompt: str | None = None,
    extra: dict[str, tuple[str, np.ndarray]] | None = None,
) -> list:
    tensors = []
    if prompt_ids is not None:
        t = grpcclient.InferInput("PROMPT_TOKEN_IDS", [len(prompt_ids)], "INT32")
        t.set_data_from_numpy(np.array(prompt_ids, dtype=np.int32))
        tensors.append(t)
    if prompt is not None:
        t = grpcclient.InferInput("PROMPT", [1], "BYTES")
        t.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        tensors.append(t)
    t = grpcclient.InferInput("MAX_TOKENS", [1], "INT32")
    t.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    tensors.append(t)
    for name, (datatype, value) in (extra or {}).items():
        t = grpcclient.InferInput(name, list(value.shape), datatype)
        t.set_data_from_numpy(value)
        tensors.append(t)
    return tensors


class _Responses:
    """tritonclient's stream callback: every (result, error) in arrival order, by request id."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def __call__(self, result, error) -> None:
        self.items.put((result, error))

    def drain(self) -> list:
        out = []
        while not self.items.empty():
            out.append(self.items.get_nowait())
        return out


def _final(result) -> bool:
    flag = result.get_response().parameters.get("triton_final_response")
    return flag is not None and flag.bool_param


def _generate_tokens(target: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The same request through cadence's own API."""
    with Client(target) as client:
        chunks = list(client.generate(prompt_ids, max_tokens=max_tokens))
    return [t for c in chunks for t in c.token_ids]


def test_every_token_arrives_in_order_with_the_final_flag(server) -> None:
    """Eight requests on one stream, interleaved: each id gets its tokens in order, the final
    flag only on its last response, and the same tokens as cadence's own API gives."""
    responses = _Responses()
    client = grpcclient.InferenceServerClient(server.target)
    prompts = {f"r{i}": [65 + i, 66 + i, 67 + i] for i in range(8)}
    client.start_stream(callback=responses)
    try:
        for request_id, prompt in prompts.items():
            client.async_stream_infer(MODEL, _inputs(prompt, 24), request_id=request_id)
    finally:
        client.stop_stream()  # half-close: returns once every response has arrived
        client.close()
    by_id: dict[str, list] = {request_id: [] for request_id in prompts}
    for result, error in responses.drain():
        assert error is None, error
        by_id[result.get_response().id].append(result)
    for request_id, results in by_id.items():
        tokens = [int(t) for r in results for t in r.as_numpy("TOKEN_IDS")]
        assert tokens == _generate_tokens(server.target, prompts[request_id], 24)
        assert [_final(r) for r in results] == [False] * (len(results) - 1) + [True]
        last = results[-1].get_response()
        assert last.parameters["finish_reason"].string_param == "length"
        assert last.model_name == MODEL and last.model_version == "1"
        text = b"".join(r.as_numpy("TEXT")[0] for r in results)
        assert text == bytes(tokens)  # the synthetic engine's tokens are bytes


def test_text_prompt_sampling_inputs_and_requested_outputs(server) -> None:
    responses = _Responses()
    client = grpcclient.InferenceServerClient(server.target)
    client.start_stream(callback=responses)
    extra = {
        "TEMPERATURE": ("FP32", np.array([0.0], dtype=np.float32)),
        "SEED": ("UINT64", np.array([7], dtype=np.uint64)),
    }
    client.async_stream_infer(
        MODEL,
        _inputs(prompt="hello", max_tokens=6, extra=extra),
        request_id="text",
        outputs=[grpcclient.InferRequestedOutput("TEXT")],
    )
    client.stop_stream()
    client.close()
    results = [result for result, error in responses.drain() if error is None]
    assert all(r.as_numpy("TOKEN_IDS") is None for r in results)
    text = b"".join(r.as_numpy("TEXT")[0] for r in results).decode()
    with Client(server.target) as cadence_client:
        assert text == cadence_client.complete("hello", max_tokens=6, seed=7)  # SEED reached it
        assert text != cadence_client.complete("hello", max_tokens=6)


def test_metadata_config_liveness_and_readiness(server) -> None:
    client = grpcclient.InferenceServerClient(server.target)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
        assert not client.is_model_ready("other") and not client.is_model_ready(MODEL, "2")
        assert client.get_server_metadata().name == "cadence"
        metadata = client.get_model_metadata(MODEL)
        assert metadata.versions == ["1"]
        assert {t.name: t.datatype for t in metadata.inputs} == {
            "PROMPT": "BYTES",
            "PROMPT_TOKEN_IDS": "INT32",
            "MAX_TOKENS": "INT32",
            "TEMPERATURE": "FP32",
            "TOP_P": "FP32",
            "TOP_K": "INT32",
            "SEED": "UINT64",
            "STOP_TOKEN_IDS": "INT32",
        }
        assert [(t.name, t.datatype) for t in metadata.outputs] == [
            ("TOKEN_IDS", "INT32"),
            ("TEXT", "BYTES"),
        ]
        config = client.get_model_config(MODEL).config
        assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
        assert {i.name for i in config.input if not i.optional} == {"MAX_TOKENS"}
        with pytest.raises(InferenceServerException) as missing:
            client.get_model_metadata("other")
        assert missing.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException) as unary:
            client.infer(MODEL, _inputs([1, 2], 4))
        assert unary.value.status() == "StatusCode.UNIMPLEMENTED"
        assert "decoupled" in unary.value.message()
        stats = client.get_inference_statistics(MODEL).model_stats[0]
        assert stats.name == MODEL and stats.version == "1"
    finally:
        client.close()


def test_bad_input_is_an_in_band_error_and_the_stream_goes_on(server) -> None:
    responses = _Responses()
    client = grpcclient.InferenceServerClient(server.target)
    client.start_stream(callback=responses)
    bad_type = grpcclient.InferInput("MAX_TOKENS", [1], "FP32")
    bad_type.set_data_from_numpy(np.array([4.0], dtype=np.float32))
    unknown = _inputs([1, 2], 4, extra={"COLOR": ("INT32", np.array([1], dtype=np.int32))})
    client.async_stream_infer(MODEL, _inputs([1, 2], 0), request_id="zero")
    client.async_stream_infer(MODEL, [_inputs([1, 2])[0], bad_type], request_id="type")
    client.async_stream_infer(MODEL, unknown, request_id="unknown")
    client.async_stream_infer(MODEL, _inputs([1, 2])[:1], request_id="missing")
    client.async_stream_infer("other", _inputs([1, 2], 4), request_id="model")
    client.async_stream_infer(MODEL, _inputs([300], 4), request_id="engine")  # not a byte
    client.async_stream_infer(MODEL, _inputs([1, 2], 3), request_id="i" * 257)  # too long
    client.async_stream_infer(MODEL, _inputs([1, 2], 3), request_id="good")
    client.async_stream_infer(MODEL, _inputs([1, 2], 3), request_id="k" * 256)  # the most
    client.stop_stream()
    client.close()
    errors, good = [], []
    for result, error in responses.drain():
        if error is not None:
            errors.append(error.message())
        else:
            good.append(result)
    expected = [
        "INVALID_ARGUMENT: input 'MAX_TOKENS' is 0",
        "INVALID_ARGUMENT: input 'MAX_TOKENS' has datatype 'FP32'",
        "INVALID_ARGUMENT: unknown input 'COLOR'",
        "INVALID_ARGUMENT: input 'MAX_TOKENS' is missing",
        "NOT_FOUND: unknown model 'other'",
        "INVALID_ARGUMENT: request_id is 257 bytes long; at most 256",
    ]
    for start in expected:
        assert any(message.startswith(start) for message in errors), (start, errors)
    # The engine refuses the out-of-range token after admission: an in-band error too.
    assert len(errors) == len(expected) + 1
    assert {r.get_response().id for r in good} == {"good", "k" * 256} and _final(good[-1])


def _wait_streaming(responses: _Responses, ids: set[str]) -> None:
    """Until each of `ids` has had a response (a busy host may admit one after another's
    first response)."""
    deadline = time.monotonic() + 10
    seen: set[str] = set()
    while seen != ids:
        result, error = responses.items.get(timeout=max(0.1, deadline - time.monotonic()))
        assert error is None, error
        seen.add(result.get_response().id)


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_closing_the_stream_aborts_its_requests(server_factory) -> None:
    """A client that cancels its stream frees the requests' slots at once and the engine
    drops them: with --max-concurrent 2 a new request gets in again."""
    running = server_factory("--step-ms", "5", "--max-concurrent", "2")
    first = _Responses()
    client = grpcclient.InferenceServerClient(running.target)
    client.start_stream(callback=first)
    for request_id in ("a", "b"):
        client.async_stream_infer(MODEL, _inputs([1, 2], 5000), request_id=request_id)
    _wait_streaming(first, {"a", "b"})
    with Client(running.target) as cadence_client, pytest.raises(grpc.RpcError) as full:
        list(cadence_client.generate("third", max_tokens=2))
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    client.stop_stream(cancel_requests=True)
    client.close()
    with Client(running.target) as cadence_client:
        deadline = time.monotonic() + 10
        while True:  # the slots come free within a moment of the cancel
            try:
                assert len(list(cadence_client.generate("third", max_tokens=2))) >= 1
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the cancelled stream kept its slots"
                time.sleep(0.05)


@runs_once
def test_closing_the_stream_shows_in_the_metrics() -> None:

    with start_server("--step-ms", "5", "--metrics-port", "0") as running:
        url = running.metrics_url
        responses = _Responses()
        client = grpcclient.InferenceServerClient(running.target)
        client.start_stream(callback=responses)
        for request_id in ("a", "b", "c"):
            client.async_stream_infer(MODEL, _inputs([1, 2], 5000), request_id=request_id)
        _wait_streaming(responses, {"a", "b", "c"})
        assert _metric(url, "cadence_active_streams") == 3
        client.stop_stream(cancel_requests=True)
        client.close()
        deadline = time.monotonic() + 10
        while _metric(url, "cadence_active_streams") != 0:
            assert time.monotonic() < deadline, "the cancelled requests stayed open"
            time.sleep(0.05)
        assert _metric(url, 'cadence_requests_total{code="CANCELLED",protocol="kserve"}') == 3
        # Far fewer than 3 x 5000 tokens were made: the engine stopped on the abort.
        assert _metric(url, "cadence_output_tokens_total") < 3 * 1000


def test_reflection_lists_the_inference_service(server) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="inference.GRPCInferenceService"
            ),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="cadence.v1.Inference"),
        ]
        listed, kserve_file, cadence_file = list(stub.ServerReflectionInfo(iter(requests)))
    names = {s.name for s in listed.list_services_response.service}
    assert {"inference.GRPCInferenceService", "cadence.v1.Inference"} <= names
    assert len(kserve_file.file_descriptor_response.file_descriptor_proto) == 2  # + model_config
    assert cadence_file.file_descriptor_response.file_descriptor_proto


def test_a_thread_per_stream_client_like_perf_analyzer(server) -> None:
    """Several tritonclient streams at once, each with requests in sequence."""
    failures: list = []

    def lane(k: int) -> None:
        responses = _Responses()
        client = grpcclient.InferenceServerClient(server.target)
        client.start_stream(callback=responses)
        try:
            for i in range(3):
                client.async_stream_infer(
                    MODEL,
                    _inputs([k, i], 10),
                    request_id=f"{k}-{i}",
                    enable_empty_final_response=True,
                )
                count = 0
                while True:
                    result, error = responses.items.get(timeout=10)
                    if error is not None:
                        failures.append(error)
                        return
                    tokens = result.as_numpy("TOKEN_IDS")
                    count += 0 if tokens is None else len(tokens)
                    if _final(result):
                        break
                if count != 10:
                    failures.append((k, i, count))
        finally:
            client.stop_stream()
            client.close()

    threads = [threading.Thread(target=lane, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures


def test_bench_speaks_the_protocol(server) -> None:
    workload = Workload(requests=12, concurrency=4, shape=RequestShape(max_tokens=(20, 20)))
    result = run_bench(server.target, workload, protocol=KServeTarget(MODEL))
    assert result.requests_ok == 12 and result.errors_by_code == {}
    assert result.output_tokens == 12 * 20
    assert all(v == 0 for v in msgspec.structs.asdict(result.integrity).values())
    assert not result.segments_ms  # the protocol carries no server timing
    assert result.workload.protocol == "kserve"
    bad = run_bench(
        server.target, Workload(requests=2, concurrency=2), protocol=KServeTarget("other")
    )
    assert bad.errors_by_code == {"NOT_FOUND": 2}


def test_the_calls_deadline_ends_its_requests(server) -> None:
    responses = _Responses()
    client = grpcclient.InferenceServerClient(server.target)
    client.start_stream(callback=responses, stream_timeout=0.5)
    client.async_stream_infer(MODEL, _inputs([1, 2], 5000), request_id="late")
    messages = []
    deadline = time.monotonic() + 10
    while not any("DEADLINE_EXCEEDED" in m for m in messages):
        assert time.monotonic() < deadline, "the deadline never ended the request"
        _, error = responses.items.get(timeout=10)
        if error is not None:
            messages.append(str(error))
    client.stop_stream()
    client.close()


@runs_once
def test_a_client_that_stops_reading_is_cut_off() -> None:
    from cadence.lab.load.kserve import build_request
    from cadence.lab.load.plan import RequestPlan
    from cadence.proto.kserve import grpc_service_pb2_grpc as kpb_grpc

    args = ("--step-ms", "1", "--stall-timeout", "0.5", "--metrics-port", "0")
    with start_server(*args) as running:
        url = running.metrics_url
        small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        with grpc.insecure_channel(running.target, options=small_window) as channel:
            stalled = threading.Event()

            def requests():
                yield build_request(KServeTarget(MODEL), RequestPlan("slow", [1, 2], 16000))
                stalled.wait(30)  # keep the call open, read nothing

            call = kpb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                requests(), timeout=60
            )
            next(call)
            deadline = time.monotonic() + 15
            cut_off = 'cadence_requests_total{code="RESOURCE_EXHAUSTED",protocol="kserve"}'
            while _metric(url, cut_off) != 1:
                assert time.monotonic() < deadline, "the stalled call was never cut off"
                time.sleep(0.1)
            assert _metric(url, "cadence_active_streams") == 0
            stalled.set()
            # Reading again, the client gets what was sent, then the call's status, not a
            # wait for its deadline.
            with pytest.raises(grpc.RpcError) as cut:
                for _ in call:
                    pass
            assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--stall-timeout" in cut.value.details()
