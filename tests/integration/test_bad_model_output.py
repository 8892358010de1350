"""A model that gives what no stream can carry, on real servers: a text piece of 10 MB, a text
with a lone surrogate, an iterator of outputs that raises. Each fails its request with one
clear message; the worker lives on, serves the next request, and the front answers
meanwhile. And a sequence paused by `--overflow block` stays paused when `--preempt` takes
its slot and gives it back.

The models are tests/batched_models.py's `BadOutputModel` (`huge N`, `surrogate`, `raising`),
`BadTokenizerModel` and `DecodeOnlyTokenizerModel` (a tokenizer whose encode, decode or
stream raises, or whose stream gives a lone surrogate or 10 MB), and tests/apps.py's
`bad_tokenizer_app` (the same tokenizer); `StreamOnlyTokenizerModel` and
`stream_only_tokenizer_app` (a tokenizer without decode, sent a prompt as token ids). And a client that reads slowly while big pieces pile
up at the front gets them in chunks a default client accepts (4 MiB at most).
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cadence.client import Client, build_request
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.proto.kserve import grpc_service_pb2_grpc as kpb_grpc
from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import RunningServer, start_server, wait_until

_SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def servers(importable_models) -> Iterator[Callable[[str, str], RunningServer]]:
    """Servers by their engine or app (`--engine X` or `--app X`), each started when a test
    first asks for it (`_server`), all stopped at the module's end. One worker each, so that
    the request after a bad one runs on the same worker."""
    with contextlib.ExitStack() as stack:
        started: dict[str, RunningServer] = {}

        def start(flag: str, name: str) -> RunningServer:
            if name not in started:
                started[name] = stack.enter_context(
                    start_server(flag, name, "--devices", "cpu:1", "--metrics-port", "0")
                )
            return started[name]

        yield start


@pytest.fixture(scope="module")
def bad_server(servers) -> RunningServer:
    return servers("--engine", "tests.batched_models:BadOutputModel")


@pytest.mark.parametrize(
    "prompt, says",
    [
        ("huge 10000000", "10,000,000 bytes, over the 1,048,576 bytes (1 MiB) one output may hold"),
        ("huge 300000", "a text of 300,000 token ids, over the 262,144 one output may hold"),
        ("surrogate", "a text that UTF-8 cannot carry"),
        (
            "raising",
            "returned a generator whose iteration raised RuntimeError: the outputs' "
            "iterator failed on purpose",
        ),
    ],
    ids=["huge-text", "too-many-ids", "lone-surrogate", "raising-iterator"],
)
def test_a_bad_output_fails_its_request_and_the_worker_serves_the_next(
    bad_server, prompt, says
) -> None:
    _fails_alone(bad_server, prompt, "BadOutputModel.step returned", says)


@pytest.mark.parametrize(
    "flag, name, prompt, says",
    [
        (
            "--engine",
            "tests.batched_models:BadTokenizerModel",
            "say ENCODE-FAILS",
            "BadTokenizerModel.tokenizer.encode raised RuntimeError: the tokenizer's encode failed",
        ),
        (
            "--engine",
            "tests.batched_models:BadTokenizerModel",
            "encode-fails",
            "BadTokenizerModel.tokenizer.encode raised RuntimeError: the tokenizer's encode failed",
        ),
        (
            "--engine",
            "tests.batched_models:BadTokenizerModel",
            "stream-raises",
            "BadTokenizerModel.tokenizer.stream raised RuntimeError: the tokenizer's stream failed",
        ),
        (
            "--engine",
            "tests.batched_models:DecodeOnlyTokenizerModel",
            "stream-raises",
            "DecodeOnlyTokenizerModel.tokenizer.decode raised RuntimeError: the tokenizer's decode",
        ),
        (
            "--engine",
            "tests.batched_models:BadTokenizerModel",
            "stream-surrogate",
            "BadTokenizerModel.tokenizer.stream gave a text that UTF-8 cannot carry",
        ),
        (
            "--engine",
            "tests.batched_models:BadTokenizerModel",
            "stream-huge",
            "BadTokenizerModel.tokenizer.stream gave a text of 10,000,000 bytes, over the 1,048,576",
        ),
        (
            "--app",
            "tests.apps:bad_tokenizer_app",
            "say ENCODE-FAILS",
            "the app's tokenizer.encode raised RuntimeError: the tokenizer's encode failed",
        ),
        (
            "--app",
            "tests.apps:bad_tokenizer_app",
            "encode-fails",
            "the app's tokenizer.encode raised RuntimeError: the tokenizer's encode failed",
        ),
        (
            "--app",
            "tests.apps:bad_tokenizer_app",
            "stream-raises",
            "the app's tokenizer.stream raised RuntimeError: the tokenizer's stream failed",
        ),
        (
            "--app",
            "tests.apps:bad_tokenizer_app",
            "stream-surrogate",
            "the app's tokenizer.stream gave a text that UTF-8 cannot carry",
        ),
        (
            "--app",
            "tests.apps:bad_tokenizer_app",
            "stream-huge",
            "the app's tokenizer.stream gave a text of 10,000,000 bytes, over the 1,048,576",
        ),
    ],
    ids=[
        "model-encode-prompt",
        "model-encode-piece",
        "model-stream-raises",
        "model-decode-raises",
        "model-stream-surrogate",
        "model-stream-huge",
        "app-encode-prompt",
        "app-encode-piece",
        "app-stream-raises",
        "app-stream-surrogate",
        "app-stream-huge",
    ],
)
def test_a_bad_tokenizer_fails_its_request_and_the_worker_serves_the_next(
    servers, flag, name, prompt, says
) -> None:
    _fails_alone(servers(flag, name), prompt, "", says)


@pytest.mark.parametrize(
    "flag, name, says",
    [
        (
            "--engine",
            "tests.batched_models:StreamOnlyTokenizerModel",
            "StreamOnlyTokenizerModel.tokenizer has no decode(ids)",
        ),
        ("--app", "tests.apps:stream_only_tokenizer_app", "the app's tokenizer has no decode(ids)"),
    ],
    ids=["model", "app"],
)
def test_prompt_token_ids_without_a_tokenizer_decode_are_refused_alone(
    servers, flag, name, says
) -> None:
    """A tokenizer that streams on its own but has no `decode` cannot give the model (or app)
    the text of a prompt sent as token ids: that request is refused with INVALID_ARGUMENT and
    one line saying so, before it reaches a step; text prompts and the worker go on."""
    server = servers(flag, name)
    with Client(server.target) as client:
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate(list(b"count 5"), max_tokens=5, timeout=30))
        chunks = list(client.generate("count 5", max_tokens=5, timeout=30))
    error = refused.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert says in error.details() and "as text" in error.details(), error.details()
    assert "\n" not in error.details()
    assert "".join(c.text for c in chunks) == "01234"
    assert _metric(server.metrics_url, "cadence_worker_restarts_total") == 0


def _fails_alone(server: RunningServer, prompt: str, origin: str, says: str) -> None:
    """`prompt` ends INTERNAL saying `origin` and `says`; the front answers health meanwhile;
    the worker, not restarted, serves the next request."""
    target = server.target
    failed: list[grpc.RpcError] = []

    def bad_request() -> None:
        with Client(target) as client:
            try:
                list(client.generate(prompt, max_tokens=40, timeout=60))
            except grpc.RpcError as exc:
                failed.append(exc)

    thread = threading.Thread(target=bad_request)
    thread.start()
    # The front answers health while the model's output is dealt with (10 MB pieces stalled
    # it until the worker, its heartbeats unanswered, gave up).
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while thread.is_alive():
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            time.sleep(0.2)
    thread.join()
    [error] = failed
    assert error.code() == grpc.StatusCode.INTERNAL, error.details()
    assert origin in error.details() and says in error.details(), error.details()
    assert "\n" not in error.details()
    with Client(target) as client:
        chunks = list(client.generate("count 5", max_tokens=5, timeout=30))
    assert "".join(c.text for c in chunks) == "01234"
    assert _metric(server.metrics_url, "cadence_worker_restarts_total") == 0


@pytest.mark.parametrize("protocol", ["cadence.v1", "kserve"])
def test_merged_chunks_fit_a_default_clients_limit(bad_server, protocol) -> None:
    """Outputs of 200 kB pile up for a client that reads nothing for a while (--overflow
    merge): merged, 40 of them would be one message of 16 MB (KServe: 40 MB), which a default
    client (4 MiB at most per message) refuses with RESOURCE_EXHAUSTED; the front sends them
    over several messages, each under 3 MiB of output, and loses nothing."""
    with grpc.insecure_channel(bad_server.target, options=_SMALL_WINDOW) as channel:
        if protocol == "kserve":
            responses = kpb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter([_kserve_request("huge 200000", 40)]), timeout=60
            )
        else:
            responses = pb_grpc.InferenceStub(channel).Generate(
                build_request("huge 200000", max_tokens=40), timeout=60
            )
        got = [next(responses)]
        wait_until(
            lambda: _metric(bad_server.metrics_url, "cadence_deepest_buffer_steps") >= 20,
            30,
            "the outputs never piled up at the front",
        )
        got += list(responses)
    sizes = [r.ByteSize() for r in got]
    assert max(sizes) <= 3 << 20, sizes
    assert len(got) >= 4, sizes
    # Each text piece is one output (one position) whatever its 200,000 ids.
    if protocol == "kserve":
        assert not any(r.error_message for r in got)
        outputs = [r.infer_response for r in got if r.infer_response.outputs]
        tokens = sum(len(r.raw_output_contents[0]) // 4 for r in outputs)
        # BYTES: a 4-byte length, then the text
        text = sum(len(r.raw_output_contents[1]) - 4 for r in outputs)
        positions = [r.parameters["outputs"].int64_param for r in outputs]
    else:
        tokens, text = sum(len(c.token_ids) for c in got), sum(len(c.text) for c in got)
        positions = [c.outputs for c in got if c.token_ids]
        assert [c.index for c in got] == [sum(c.outputs for c in got[:i]) for i in range(len(got))]
        assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert tokens == text == 40 * 200_000
    assert sum(positions) == 40 and min(positions) >= 1, positions


def _kserve_request(prompt: str, max_tokens: int) -> kpb.ModelInferRequest:
    tensor = kpb.ModelInferRequest.InferInputTensor
    return kpb.ModelInferRequest(
        model_name="cadence",
        inputs=[
            tensor(
                name="PROMPT",
                datatype="BYTES",
                shape=[1],
                contents=kpb.InferTensorContents(bytes_contents=[prompt.encode()]),
            ),
            tensor(
                name="MAX_TOKENS",
                datatype="INT32",
                shape=[1],
                contents=kpb.InferTensorContents(int_contents=[max_tokens]),
            ),
        ],
    )


def test_a_paused_sequence_stays_paused_when_preempted() -> None:
    """`--overflow block --preempt`, one slot: a client that reads nothing has its sequence
    paused; a request of higher priority preempts it and finishes; the paused sequence,
    admitted again, gives at most its re-prefill's output and stays paused (its tokens do not
    pile up at the front), then, once its client reads, streams whole."""
    args = (
        "--devices",
        "cpu:1",
        "--max-batch",
        "1",
        "--step-ms",
        "2",
        "--preempt",
        "--overflow",
        "block",
        "--queue-capacity",
        "8",
        "--metrics-port",
        "0",
    )
    with start_server(*args) as server:
        url = server.metrics_url
        slow_channel = grpc.insecure_channel(server.target, options=_SMALL_WINDOW)
        slow = pb_grpc.InferenceStub(slow_channel).Generate(
            build_request("slow", max_tokens=2000, priority=1), timeout=120
        )
        first = next(slow)
        wait_until(
            lambda: _metric(url, "cadence_paused_sequences") == 1,
            30,
            "the slow stream was never paused",
        )
        # The only slot is held by the paused sequence: this one is served only by preempting it.
        with Client(server.target) as client:
            urgent = list(client.generate("urgent", max_tokens=20, priority=0, timeout=30))
        assert urgent[-1].finish_reason == pb.FINISH_REASON_LENGTH
        # 2000 steps of 2 ms would pile up here in 4 s; paused, a few in-flight ones at most.
        time.sleep(3)
        assert _metric(url, "cadence_deepest_buffer_steps") <= 8 + 16
        assert _metric(url, "cadence_paused_sequences") == 1
        rest = list(slow)
        tokens = [t for c in [first, *rest] for t in c.token_ids]
        assert [c.index for c in [first, *rest]] == [
            sum(len(c.token_ids) for c in [first, *rest][:i]) for i in range(len(rest) + 1)
        ]
        assert len(tokens) == 2000 and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        slow_channel.close()
