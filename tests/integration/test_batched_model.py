"""End to end: users' batched model classes (tests/batched_models.py) served by real
`cadence serve --engine MODULE:CLASS` processes (and `cadence.serve(MyModel)`), over real
sockets: batching, finishes, cancel, deadline, a failing step, a hanging step, a model's own
vocabulary, tensor parallelism, start-up errors."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from cadence.client import AsyncClient, Client
from cadence.proto.v1 import inference_pb2 as pb
from tests.integration.conftest import RunningServer, serve_refused, start_server

MODELS = "tests.batched_models"


pytestmark = pytest.mark.usefixtures("importable_models")


@pytest.fixture(scope="module")
def echo_server(importable_models) -> Iterator[RunningServer]:
    running = start_server("--engine", f"{MODELS}:EchoModel", "--devices", "cpu:2")
    yield running
    assert running.stop() == 0


async def _collect(target: str, prompt: str | list[int], max_tokens: int, **options) -> list:
    async with AsyncClient(target) as client:
        return [c async for c in client.generate(prompt, max_tokens=max_tokens, **options)]


async def _many(target: str, prompts: list[tuple[str, int]]) -> list:
    return await asyncio.gather(
        *(_collect(target, p, n) for p, n in prompts), return_exceptions=True
    )


def _text(chunks: list) -> str:
    """Indexes are contiguous (each chunk covers `outputs` positions, a model's text pieces,
    or one per token id) and only the last chunk finishes; returns the whole text."""
    index = 0
    for chunk in chunks:
        assert chunk.index == index
        index += chunk.outputs or len(chunk.token_ids)
    assert [c.finish_reason for c in chunks[:-1]] == [0] * (len(chunks) - 1)
    return "".join(c.text for c in chunks)


def test_many_concurrent_streams_are_whole_and_end_as_the_model_says(echo_server) -> None:
    prompts = [("count 30", 100)] * 24 + [("count 30", 7)] * 8 + [("héllo", 11)] * 8
    results = asyncio.run(_many(echo_server.target, prompts))
    for chunks in results[:24]:
        assert _text(chunks) == "012345678901234567890123456789"
        assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP  # the model said None
    for chunks in results[24:32]:
        assert _text(chunks) == "0123456"
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    for chunks in results[32:]:
        assert _text(chunks) == "héllohéll"  # 11 byte tokens, é being two of them
        assert [t for c in chunks for t in c.token_ids] == list("héllohéll".encode())


def test_steps_are_batched(echo_server) -> None:
    """64 streams of 20 steps of 10 ms each: one by one that is 12.8 s; batched on two
    workers about 20 steps' time. Every output says how many sequences its step ran."""
    start = time.monotonic()
    results = asyncio.run(_many(echo_server.target, [("batch", 20)] * 64))
    elapsed = time.monotonic() - start
    sizes = [int(s) for chunks in results for s in _text(chunks).split()]
    assert len(sizes) == 64 * 20
    assert max(sizes) >= 16, f"steps ran at most {max(sizes)} sequences"
    assert elapsed < 6.0, f"64 streams took {elapsed:.1f} s"


def _wait_for_line(path: Path, pattern: str, timeout: float = 10.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        match = re.search(pattern, path.read_text() if path.exists() else "")
        if match:
            return match
        assert time.monotonic() < deadline, f"{path} holds {match!r}"
        time.sleep(0.02)


def test_cancel_releases_the_sequence_within_a_step_or_so(echo_server, tmp_path) -> None:
    record = tmp_path / "cancel.txt"
    with Client(echo_server.target) as client:
        seen = ""
        for n, chunk in enumerate(client.generate(f"record {record}", max_tokens=10**4)):
            seen += chunk.text
            if n == 5:
                break  # leaving the loop cancels the call
    last_step = int(seen.split()[-1])
    released = _wait_for_line(record, r"released after (\d+) outputs at step (\d+)")
    # Outputs already on their way when the cancel left are the only ones it could not stop.
    assert int(released.group(2)) - last_step <= 5, (seen, released.group(0))
    assert int(released.group(1)) < 50


def test_a_deadline_ends_the_stream_and_releases_the_sequence(echo_server, tmp_path) -> None:
    record = tmp_path / "deadline.txt"
    with Client(echo_server.target) as client, pytest.raises(grpc.RpcError) as info:
        list(client.generate(f"record {record}", max_tokens=10**4, timeout=0.3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    released = _wait_for_line(record, r"released after (\d+) outputs")
    assert 5 <= int(released.group(1)) < 100  # 0.3 s of 10 ms steps, and no more


def test_a_raising_step_fails_its_sequences_only(echo_server) -> None:
    async def run() -> tuple:
        async with AsyncClient(echo_server.target) as client:
            long = [
                asyncio.ensure_future(_collect(echo_server.target, "count 60", 100))
                for _ in range(4)
            ]
            await asyncio.sleep(0.1)  # the long ones run; the failing one joins their steps
            failed = await asyncio.gather(
                _collect(echo_server.target, "fail", 50), return_exceptions=True
            )
            together = await asyncio.gather(*long, return_exceptions=True)
            after = await _many(echo_server.target, [("count 20", 50)] * 8)
            assert await client.health() == "SERVING"
            return failed[0], together, after

    failed, together, after = asyncio.run(run())
    message = "EchoModel.step raised ValueError: failed on purpose"
    assert isinstance(failed, grpc.aio.AioRpcError)
    assert failed.code() == grpc.StatusCode.INTERNAL and failed.details() == message
    for result in together:  # on the failing one's worker they shared its step; else whole
        if isinstance(result, grpc.aio.AioRpcError):
            assert (result.code(), result.details()) == (grpc.StatusCode.INTERNAL, message)
        else:
            assert _text(result) == "012345678901234567890123456789012345678901234567890123456789"
    for chunks in after:  # the same workers serve the streams that came later
        assert _text(chunks) == "01234567890123456789"


@pytest.mark.parametrize(
    ("model", "prompt", "code", "message"),
    [
        (
            "EchoModel",
            "fail-alone",
            grpc.StatusCode.INTERNAL,
            "EchoModel.step failed this request: ValueError: failed on purpose",
        ),
        ("EchoModel", "refuse", grpc.StatusCode.RESOURCE_EXHAUSTED, "no room for this one"),
        (
            "BadOutputModel",
            "surrogate",
            grpc.StatusCode.INTERNAL,
            "BadOutputModel.step returned a text that UTF-8 cannot carry (surrogates not allowed",
        ),
        (
            "StreamModel",
            "fail-alone",
            grpc.StatusCode.INTERNAL,
            "StreamModel.generate_stream failed this request: ValueError: failed on purpose",
        ),
    ],
    ids=["exception", "sequence-error", "bad-output", "generate-stream"],
)
def test_one_sequences_failure_leaves_the_other_15_streams_of_its_step_whole(
    importable_models, model, prompt, code, message
) -> None:
    """16 streams on one worker: 15 count to 40 while the 16th, sharing their steps, gets an
    exception (or a text no stream can carry) in its place at its third output. It alone
    ends, with its status and message; the 15 get every output and finish as the model says."""
    server = start_server(
        "--engine", f"{MODELS}:{model}", "--devices", "cpu:1", "--batch-timeout-ms", "300"
    )

    async def run() -> list:
        others = [
            asyncio.ensure_future(_collect(server.target, "count 40", 100)) for _ in range(15)
        ]
        if model != "StreamModel":  # a step model: it joins their running steps
            await asyncio.sleep(0.1)
        bad = asyncio.ensure_future(_collect(server.target, prompt, 100))
        return await asyncio.gather(bad, *others, return_exceptions=True)

    try:
        failed, *whole = asyncio.run(run())
        assert isinstance(failed, grpc.aio.AioRpcError), failed
        assert failed.code() == code and failed.details().startswith(message), failed.details()
        for chunks in whole:
            assert not isinstance(chunks, BaseException), chunks
            assert _text(chunks) == "0123456789" * 4
            assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
        with Client(server.target) as client:
            assert client.complete("count 3", max_tokens=10) == "012"
    finally:
        assert server.stop() == 0


def test_a_hanging_step_is_caught_by_the_worker_timeout(importable_models) -> None:
    server = start_server("--engine", f"{MODELS}:EchoModel", "--worker-timeout", "1.5")
    try:
        with Client(server.target) as client:
            with pytest.raises(grpc.RpcError) as info:
                list(client.generate("hang", max_tokens=50, timeout=30))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            deadline = time.monotonic() + 30
            while True:  # the replacement worker serves
                try:
                    assert client.complete("count 5", max_tokens=50) == "01234"
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline, "no replacement worker"
                    time.sleep(0.2)
    finally:
        assert server.stop() == 0


def test_a_models_own_vocabulary_streams_ids_above_255_and_exact_text(importable_models) -> None:
    from tests.batched_models import WordTokenizer

    server = start_server("--engine", f"{MODELS}:VocabModel")
    try:
        prompt = "hello héllo wörld"
        ids = WordTokenizer().encode(prompt)
        with Client(server.target) as client:
            chunks = list(client.generate(prompt, max_tokens=3 * len(ids)))
            assert [t for c in chunks for t in c.token_ids] == ids * 3
            assert _text(chunks) == prompt * 3
            assert chunks[0].prompt_tokens == len(ids)  # counted by the model's tokenizer
            # Token ids in: the model's own ids, words above 255.
            chunks = list(client.generate([1000, 1004, 1002, 1004], max_tokens=8))
            assert _text(chunks) == "hello cadence hello cadence "
            with pytest.raises(grpc.RpcError) as info:
                list(client.generate([1005], max_tokens=4))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        assert server.stop() == 0


def test_text_pieces_count_one_output_each_on_every_protocol(importable_models, tmp_path) -> None:
    """A model whose every output is a text piece of 7 bytes ("wörd3 "): each piece is one
    output on cadence.v1 (chunk `index` and `outputs`), KServe (the `outputs` parameter) and
    OpenAI (`usage.completion_tokens`, the `cadence` extension), the text and its byte ids
    arrive exactly, and `cadence bench` judges the streams whole over all three and exits 0."""
    import json

    import msgspec
    import openai

    from cadence.lab.results import BenchResult
    from cadence.proto.kserve import grpc_service_pb2 as kpb
    from cadence.proto.kserve import grpc_service_pb2_grpc as kpb_grpc

    server = start_server("--engine", f"{MODELS}:PieceModel", "--devices", "cpu:1", http=True)
    expected = "".join(f"wörd{i} " for i in range(12))
    try:
        with Client(server.target) as client:
            chunks = list(client.generate("hi", max_tokens=12))
        positions = [c.outputs or len(c.token_ids) for c in chunks]
        assert [c.index for c in chunks] == [sum(positions[:i]) for i in range(len(chunks))]
        assert sum(positions) == 12 and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert "".join(c.text for c in chunks) == expected
        assert bytes(t for c in chunks for t in c.token_ids) == expected.encode()

        with grpc.insecure_channel(server.target) as channel:
            tensor = kpb.ModelInferRequest.InferInputTensor
            request = kpb.ModelInferRequest(
                model_name="cadence",
                inputs=[
                    tensor(
                        name="PROMPT",
                        datatype="BYTES",
                        shape=[1],
                        contents=kpb.InferTensorContents(bytes_contents=[b"hi"]),
                    ),
                    tensor(
                        name="MAX_TOKENS",
                        datatype="INT32",
                        shape=[1],
                        contents=kpb.InferTensorContents(int_contents=[12]),
                    ),
                ],
            )
            responses = list(
                kpb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                    iter([request]), timeout=30
                )
            )
        counts = [
            r.infer_response.parameters["outputs"].int64_param
            for r in responses
            if r.infer_response.outputs
        ]
        assert sum(counts) == 12, counts
        text = b"".join(
            r.infer_response.raw_output_contents[1][4:]
            for r in responses
            if r.infer_response.outputs
        )
        assert text.decode() == expected

        http = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
        model = http.models.list().data[0].id
        events = list(
            http.completions.create(
                model=model,
                prompt="hi",
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(e.choices[0].text for e in events if e.choices) == expected
        assert events[-1].usage.completion_tokens == 12
        whole = http.completions.create(model=model, prompt="hi", max_tokens=12)
        assert whole.choices[0].text == expected and whole.usage.completion_tokens == 12

        for protocol, target in (
            ("cadence", server.target),
            ("kserve", server.target),
            ("openai", server.base),
        ):
            out = tmp_path / f"{protocol}.json"
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "cadence.cli",
                    "bench",
                    "--target",
                    target,
                    "--protocol",
                    protocol,
                    "--no-progress",
                    "--concurrency",
                    "8",
                    "--requests",
                    "16",
                    "--max-tokens",
                    "20",
                    "--json",
                    str(out),
                ],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 0, (protocol, done.stdout, done.stderr)
            result = msgspec.convert(json.loads(out.read_text()), BenchResult)
            assert result.requests_ok == 16, protocol
            assert result.output_tokens == 16 * 20, (protocol, result.output_tokens)
            assert all(v == 0 for v in msgspec.structs.asdict(result.integrity).values()), (
                protocol,
                result.integrity,
            )
    finally:
        assert server.stop() == 0


@pytest.mark.slow
@pytest.mark.torch
def test_text_pieces_count_one_output_each_with_two_fronts(importable_models) -> None:
    """With `--fronts 2` each front gets its part of a step: a piece is still one output on
    either front, for streams owned by both."""
    server = start_server("--engine", f"{MODELS}:PieceModel", "--devices", "cpu:1", "--fronts", "2")
    expected = "".join(f"wörd{i} " for i in range(12))
    try:
        for _ in range(6):  # connections spread over both fronts
            with Client(server.target) as client:
                chunks = list(client.generate("hi", max_tokens=12))
            positions = [c.outputs or len(c.token_ids) for c in chunks]
            assert sum(positions) == 12 and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert [c.index for c in chunks] == [sum(positions[:i]) for i in range(len(chunks))]
            assert "".join(c.text for c in chunks) == expected
    finally:
        server.stop()


def test_tensor_parallel_ranks_step_together(importable_models) -> None:
    pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")
    server = start_server("--engine", f"{MODELS}:GroupModel", "--devices", "cpu:2", "--tp", "2")
    try:
        assert len(server.workers) == 2  # one worker of two ranks
        with Client(server.target) as client:
            texts = asyncio.run(_many(server.target, [("x", 6)] * 4))
            for chunks in texts:
                assert _text(chunks) == "0/2 3 " * 6  # rank 0 of 2; ranks 1 + 2 summed
            assert client.complete("y", max_tokens=2) == "0/2 3 0/2 3 "
    finally:
        assert server.stop() == 0


def test_serve_a_model_class_from_python(importable_models) -> None:
    code = (
        "import cadence\nfrom tests.batched_models import EchoModel\n"
        "if __name__ == '__main__':\n"
        "    cadence.serve(EchoModel, devices='cpu:2', port=0, max_batch=16)\n"
    )
    server = start_server(command=[sys.executable, "-c", code])
    try:
        assert len(psutil.Process(server.pid).children()) == 2
        # max_batch=16 took effect: no batch above it, and one at it. On a busy host a burst
        # of 40 may come in too spread out to fill one; another burst does.
        seen: list[int] = []
        for _ in range(5):
            results = asyncio.run(_many(server.target, [("batch", 5)] * 40))
            seen += [int(s) for chunks in results for s in _text(chunks).split()]
            if max(seen) >= 16:
                break
        assert max(seen) == 16, seen
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("NoSuchModel", "cannot load model 'tests.batched_models:NoSuchModel': AttributeError"),
        ("NoStepModel", "tests.batched_models:NoStepModel has no step(prefill, decode) method"),
        ("BrokenInitModel", "BrokenInitModel('cpu') raised RuntimeError: no weights at /nowhere"),
    ],
)
def test_a_model_that_cannot_start_fails_the_start_in_one_line(
    name, problem, importable_models
) -> None:
    out = serve_refused("--startup-timeout", "20", "--engine", f"{MODELS}:{name}")
    assert out.returncode != 0
    assert f"cadence worker 0 (rank 0): {problem}" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_misspelled_member_is_named_at_start_up(importable_models, tmp_path) -> None:
    log = tmp_path / "serve.log"
    server = start_server("--engine", f"{MODELS}:MisspelledModel", "--devices", "cpu:2", log=log)
    try:
        with Client(server.target) as client:
            assert client.complete("count 3", max_tokens=10) == "012"  # it serves all the same
    finally:
        assert server.stop() == 0
    said = log.read_text()
    assert said.count("MisspelledModel has `relase`: did you mean `release`?") == 1, said
    assert "MisspelledModel has `max_batches`: did you mean `max_batch`?" in said
    assert "Traceback" not in said


def test_the_batch_generator_shape_serves_whole_batches(importable_models) -> None:
    """generate_stream(batch): concurrent requests share one generator; one that arrives
    while it runs waits for the whole batch, then runs in the next."""
    server = start_server("--engine", f"{MODELS}:StreamModel", "--batch-timeout-ms", "50")

    async def run() -> tuple[list, list]:
        batch = [asyncio.ensure_future(_collect(server.target, "batch", 30)) for _ in range(8)]
        await asyncio.sleep(0.15)  # the batch runs (30 steps of 10 ms)
        late = await _collect(server.target, "batch", 5)
        return await asyncio.gather(*batch), late

    try:
        batch, late = asyncio.run(run())
        for chunks in batch:
            assert _text(chunks) == "8 " * 30  # gathered within 50 ms into one batch
        assert _text(late) == "1 " * 5  # it did not join the running batch
        failed, ok = asyncio.run(_many(server.target, [("fail", 20), ("count 5", 20)]))
        if isinstance(ok, grpc.aio.AioRpcError):  # both were gathered into the failing batch
            assert ok.details() == failed.details()
        else:
            assert _text(ok) == "01234"
        assert failed.code() == grpc.StatusCode.INTERNAL
        assert failed.details() == (
            "StreamModel.generate_stream raised ValueError: generator failed on purpose"
        )
        with Client(server.target) as client:
            assert client.complete("count 7", max_tokens=20) == "0123456"
    finally:
        assert server.stop() == 0
