"""Disaggregated serving on real `cadence serve` processes: a prefill worker gives each
request's first token and hands its state, through the front, to a decode worker that streams
the rest (docs/architecture.md#disaggregated-serving)."""

from __future__ import annotations

import asyncio
import queue
import re
import signal
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from cadence.client import AsyncClient, Client
from tests.integration.conftest import (
    RunningServer,
    live_workers,
    serve_refused,
    start_server,
    wait_until,
)

DISAGGREGATED = ("--prefill-devices", "cpu:1", "--decode-devices", "cpu:1")
PROMPTS = [f"prompt {i}: " + "the stream " * (i + 1) for i in range(6)]


def _metric(server: RunningServer, name: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def _whole(chunks: list, max_tokens: int) -> list[int]:
    """The stream's tokens, checked whole: contiguous indices, exactly max_tokens."""
    tokens: list[int] = []
    for chunk in chunks:
        assert chunk.index == len(tokens), "a token was lost, repeated or reordered"
        tokens.extend(chunk.token_ids)
    assert len(tokens) == max_tokens
    return tokens


async def _streams(target: str, prompts: list, max_tokens: int, **options) -> list[list]:
    async with AsyncClient(target) as client:

        async def one(prompt) -> list:
            return [c async for c in client.generate(prompt, max_tokens=max_tokens, **options)]

        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.fixture(scope="module")
def colocated() -> Iterator[RunningServer]:
    server = start_server("--devices", "cpu:1", "--step-ms", "5", http=True)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def disaggregated() -> Iterator[RunningServer]:
    server = start_server(
        *DISAGGREGATED,
        "--disaggregate-above",
        "0",
        "--step-ms",
        "5",
        "--metrics-port",
        "0",
        http=True,
    )
    yield server
    assert server.stop() == 0


def test_cadence_v1_streams_whole_from_the_decode_worker(colocated, disaggregated) -> None:
    expected = asyncio.run(_streams(colocated.target, PROMPTS, 40))
    got = asyncio.run(_streams(disaggregated.target, PROMPTS, 40, include_timing=True))
    for want, chunks in zip(expected, got):
        assert _whole(chunks, 40) == _whole(want, 40)
        later = [c.timing for c in chunks if c.index > 0]
        assert later and all(t.HasField("prefill_worker") for t in later)
        assert {(t.prefill_worker, t.worker) for t in later} == {(0, 1)}
        assert all(t.handoff_ns >= chunks[0].timing.step_end_ns for t in later)
    assert _metric(disaggregated, "cadence_handoffs_total") >= len(PROMPTS)
    assert _metric(disaggregated, 'cadence_worker_role{role="prefill",worker="0"}') == 1


def test_the_lab_splits_the_handoff(disaggregated) -> None:
    from cadence.lab.bench import Workload, run_bench
    from cadence.lab.load.plan import RequestShape

    result = run_bench(
        disaggregated.target,
        Workload(
            requests=8,
            concurrency=4,
            shape=RequestShape(prompt_tokens=(32, 32), max_tokens=(16, 16)),
        ),
    )
    assert result.requests_ok == 8
    assert result.integrity.lost_tokens == result.integrity.reordered_chunks == 0
    handoff = result.handoff_segments_ms
    assert handoff.requests == 8
    assert handoff.by_prefill_worker == {"0": 8} and handoff.by_decode_worker == {"1": 8}
    assert handoff.export.count == handoff.to_decode.count == 8
    assert handoff.export.min >= 0 and handoff.to_decode.min >= 0
    # Each worker's curve in its role: the prefill worker made the 8 first tokens, each in
    # a step of its own or shared, and no gap of a stream; the decode worker the rest.
    prefill, decode = result.workers
    assert (prefill.worker, prefill.role, decode.worker, decode.role) == (
        0,
        "prefill",
        1,
        "decode",
    )
    assert prefill.token_share == 8 / (8 * 16)
    assert prefill.itl_ms_p50 != prefill.itl_ms_p50  # nan: no stream's gaps are its own
    assert prefill.queue_ms_p50 >= 0 and decode.queue_ms_p50 != decode.queue_ms_p50


def test_the_lab_splits_the_handoff_over_openai(disaggregated) -> None:
    """cadence's timing extension of the OpenAI API carries the hand-off too (KServe carries
    no server timing at all)."""
    from cadence.lab.bench import Workload, run_bench
    from cadence.lab.load.openai_http import OpenAITarget
    from cadence.lab.load.plan import RequestShape

    result = run_bench(
        "",
        Workload(
            requests=8,
            concurrency=4,
            shape=RequestShape(prompt_tokens=(32, 32), max_tokens=(16, 16)),
        ),
        protocol=OpenAITarget(disaggregated.base, "cadence"),
    )
    assert result.requests_ok == 8
    handoff = result.handoff_segments_ms
    assert handoff.requests == 8
    assert handoff.by_prefill_worker == {"0": 8} and handoff.by_decode_worker == {"1": 8}
    assert handoff.export.count == handoff.to_decode.count == 8
    # The curves see both workers in their roles (from the timing: an OpenAI target is any
    # server, whose processes the lab does not look for).
    assert {(w.worker, w.role) for w in result.workers} == {(0, "prefill"), (1, "decode")}


def test_short_prompts_skip_the_handoff() -> None:
    with start_server(
        *DISAGGREGATED, "--disaggregate-above", "64", "--step-ms", "5", "--metrics-port", "0"
    ) as server:
        chunks = asyncio.run(_streams(server.target, ["short"], 20, include_timing=True))[0]
        _whole(chunks, 20)
        assert {c.timing.worker for c in chunks} == {1}, "the decode worker ran it whole"
        assert not any(c.timing.HasField("prefill_worker") for c in chunks)
        assert _metric(server, "cadence_handoffs_total") == 0


def test_kserve_streams_whole(colocated, disaggregated) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    np = pytest.importorskip("numpy")
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(disaggregated.target)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    prompts = {f"r{i}": list(p.encode()) for i, p in enumerate(PROMPTS)}
    try:
        for request_id, prompt in prompts.items():
            ids = grpcclient.InferInput("PROMPT_TOKEN_IDS", [len(prompt)], "INT32")
            ids.set_data_from_numpy(np.array(prompt, dtype=np.int32))
            most = grpcclient.InferInput("MAX_TOKENS", [1], "INT32")
            most.set_data_from_numpy(np.array([24], dtype=np.int32))
            client.async_stream_infer("cadence", [ids, most], request_id=request_id)
    finally:
        client.stop_stream()
        client.close()
    by_id: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while not results.empty():
        result, error = results.get_nowait()
        assert error is None, error
        by_id[result.get_response().id] += [int(t) for t in result.as_numpy("TOKEN_IDS")]
    with Client(colocated.target) as reference:
        for request_id, prompt in prompts.items():
            want = [t for c in reference.generate(prompt, max_tokens=24) for t in c.token_ids]
            assert by_id[request_id] == want


def test_openai_streams_whole(colocated, disaggregated) -> None:
    openai = pytest.importorskip("openai")
    for server_a, server_b in [(colocated, disaggregated)]:
        texts = []
        for server in (server_a, server_b):
            client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
            chunks = list(
                client.completions.create(
                    model="cadence",
                    prompt=PROMPTS[3],
                    max_tokens=30,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert chunks[-1].usage.completion_tokens == 30
            texts.append("".join(c.choices[0].text for c in chunks if c.choices))
        assert texts[0] == texts[1] and len(texts[1]) == 30


def test_cancel_during_the_handoff_leaves_nothing() -> None:
    """Hand-offs slowed to 1 ms a prompt token: clients that cancel after their first token,
    while their states are being exported, free their slots, and the decode worker never
    runs them."""
    with start_server(
        *DISAGGREGATED,
        "--disaggregate-above",
        "0",
        "--step-ms",
        "5",
        "--max-concurrent",
        "3",
        "--handoff-bytes-per-token",
        "25000000",  # 1 ms a token at 25 GB/s
        "--metrics-port",
        "0",
    ) as server:

        async def run() -> None:
            async with AsyncClient(server.target) as client:
                for _ in range(3):
                    call = client.generate("y" * 500, max_tokens=400)  # a 0.5 s export
                    first = await anext(call)
                    assert first.index == 0  # the prefill worker's token
                    await call.aclose()  # cancelled while its state is exported

        asyncio.run(run())
        wait_until(lambda: _metric(server, "cadence_active_streams") == 0, 10, "a slot leaked")
        time.sleep(2)  # every export done and its state dropped by the front
        assert _metric(server, "cadence_handoffs_total") == 0
        assert _metric(server, "cadence_handoff_states_in_flight") == 0
        # Every slot is free: three new requests at once stream whole.
        for chunks in asyncio.run(_streams(server.target, ["short"] * 3, 8)):
            _whole(chunks, 8)


def test_cancel_while_states_wait_for_room() -> None:
    """One decode place, a window of one: of five requests, one decodes, one is in flight and
    three wait in the front; cancelling those leaves nothing, and the first streams whole."""
    with start_server(
        *DISAGGREGATED,
        "--disaggregate-above",
        "0",
        "--step-ms",
        "5",
        "--max-batch",
        "1",
        "--handoff-window",
        "1",
        "--metrics-port",
        "0",
    ) as server:

        async def run() -> list:
            async with AsyncClient(server.target) as client:
                first = client.generate("first one", max_tokens=300)
                head = [await anext(first)]
                calls = [client.generate(f"later {i}", max_tokens=300) for i in range(4)]
                for call in calls:
                    await anext(call)  # each got its first token from the prefill worker
                await wait_until_async_metric(server, "cadence_handoff_states_waiting", 3)
                for call in calls:
                    await call.aclose()
                return head + [c async for c in first]

        chunks = asyncio.run(run())
        _whole(chunks, 300)
        wait_until(lambda: _metric(server, "cadence_active_streams") == 0, 10, "a slot leaked")
        assert _metric(server, "cadence_handoff_states_waiting") == 0
        assert _metric(server, "cadence_handoff_states_in_flight") == 0


async def wait_until_async_metric(server: RunningServer, name: str, at_least: float) -> None:
    deadline = time.monotonic() + 20
    while _metric(server, name) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}"
        await asyncio.sleep(0.05)


def test_a_decode_worker_killed_with_states_in_flight() -> None:
    """One prefill and two decode workers, each decode worker with two places and a window of
    one: killing decode worker 1 fails exactly its streams (running, in flight, or waiting
    in the front) with UNAVAILABLE; decode worker 2's stream whole; nothing leaks."""
    with start_server(
        "--prefill-devices",
        "cpu:1",
        "--decode-devices",
        "cpu:2",
        "--disaggregate-above",
        "0",
        "--step-ms",
        "10",
        "--max-batch",
        "2",
        "--handoff-window",
        "1",
        "--no-restart",
        "--metrics-port",
        "0",
    ) as server:
        victim = live_workers(server)[1]

        async def run() -> list:
            async with AsyncClient(server.target) as client:

                async def one(i: int) -> tuple[list, grpc.aio.AioRpcError | None]:
                    chunks: list = []
                    try:
                        async for c in client.generate(
                            f"request {i}", max_tokens=200, include_timing=True
                        ):
                            chunks.append(c)
                    except grpc.aio.AioRpcError as exc:
                        return chunks, exc
                    return chunks, None

                tasks = [asyncio.create_task(one(i)) for i in range(10)]
                await wait_until_async_metric(server, "cadence_handoff_states_waiting", 1)
                victim.send_signal(signal.SIGKILL)
                return await asyncio.gather(*tasks)

        outcomes = asyncio.run(run())
        failed = [(chunks, exc) for chunks, exc in outcomes if exc is not None]
        whole = [chunks for chunks, exc in outcomes if exc is None]
        assert failed and whole
        for _chunks, exc in failed:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker 1" in exc.details()
        for chunks in whole:
            _whole(chunks, 200)
            assert {c.timing.worker for c in chunks if c.index > 0} == {2}
        wait_until(lambda: _metric(server, "cadence_active_streams") == 0, 10, "a slot leaked")
        assert _metric(server, "cadence_handoff_states_waiting") == 0
        assert _metric(server, "cadence_handoff_states_in_flight") == 0
        # What is left serves: new requests go to the live decode worker, whole.
        for chunks in asyncio.run(_streams(server.target, ["after"] * 3, 10)):
            _whole(chunks, 10)


@pytest.mark.torch
def test_torch_tokens_identical_to_a_colocated_server(tmp_path) -> None:
    """The torch engine moves a sequence's KV blocks and sampler: greedy and seeded sampled
    tokens (and text) are those of a colocated server, prompts of several blocks included."""
    pytest.importorskip("torch")
    from tests.llama_models import PROMPTS as TEXTS
    from tests.llama_models import save_model

    model = str(save_model(tmp_path / "model"))
    engine = ("--engine", "torch", "--model", model, "--kv-cache-tokens", "2048")
    prompts = [*TEXTS, "the quick brown fox " * 8]
    sampled = {"temperature": 0.8, "seed": 11}

    def outputs(server: RunningServer) -> list:
        runs = [
            asyncio.run(_streams(server.target, prompts, 16)),
            asyncio.run(_streams(server.target, prompts, 16, **sampled)),
            asyncio.run(_streams(server.target, [[5, 17, 42, 99, 3] * 5], 16)),
        ]
        return [
            ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks))
            for run in runs
            for chunks in run
        ]

    with start_server(*engine, "--devices", "cpu:1") as server:
        want = outputs(server)
    with start_server(
        *engine, *DISAGGREGATED, "--disaggregate-above", "0", "--metrics-port", "0"
    ) as server:
        got = outputs(server)
        assert _metric(server, "cadence_handoffs_total") == len(want)
    assert got == want


def test_a_model_class_without_export_state_is_refused_in_one_line(importable_models) -> None:
    out = serve_refused(
        "--startup-timeout", "20", "--engine", "tests.batched_models:EchoModel", *DISAGGREGATED
    )
    assert out.returncode != 0
    # Every worker refuses; whichever exits first is the one the start-up names.
    assert re.search(
        r"cadence worker [01] \(rank 0\): tests\.batched_models:EchoModel cannot be served "
        r"disaggregated \(--prefill-devices, --decode-devices\): it has no export_state and "
        r"import_state \(docs/models\.md\)",
        out.stderr,
    ), out.stderr
    assert "Traceback" not in out.stderr


def test_a_model_class_with_export_state_streams_as_colocated(importable_models) -> None:
    engine = ("--engine", "tests.batched_models:MovableModel")
    prompts = ["count 30", "count 5", "abcdefg", "hello world"]
    with start_server(*engine, "--devices", "cpu:1") as server:
        want = asyncio.run(_streams(server.target, prompts, 20))
    with start_server(*engine, *DISAGGREGATED, "--disaggregate-above", "0") as server:
        got = asyncio.run(_streams(server.target, prompts, 20, include_timing=True))
    for a, b in zip(want, got):
        assert "".join(c.text for c in a) == "".join(c.text for c in b)
        assert a[-1].finish_reason == b[-1].finish_reason
        assert {c.timing.worker for c in b if c.index > 0} == {1}


def test_an_import_that_raises_fails_its_sequence_alone(importable_models) -> None:
    """The decode worker's engine raises on one state: that request fails with the engine's
    message, the others stream whole, and the worker goes on serving."""
    engine = ("--engine", "tests.batched_models:FragileImportModel")
    with start_server(*engine, *DISAGGREGATED, "--disaggregate-above", "0") as server:
        pids = [w.pid for w in server.workers]

        async def run() -> list:
            async with AsyncClient(server.target) as client:

                async def one(prompt: str) -> list:
                    return [c async for c in client.generate(prompt, max_tokens=10)]

                return await asyncio.gather(
                    *(one(p) for p in ("unmovable", "count 5", "hello world")),
                    return_exceptions=True,
                )

        failed, *whole = asyncio.run(run())
        assert isinstance(failed, grpc.aio.AioRpcError), failed
        assert failed.code() == grpc.StatusCode.INTERNAL
        assert "import_state raised ValueError: this state cannot be taken here" in (
            failed.details() or ""
        )
        for chunks in whole:
            assert not isinstance(chunks, BaseException), chunks
            assert chunks[-1].finish_reason
        again = asyncio.run(_streams(server.target, ["hello world"], 10))
        assert again[0][-1].finish_reason
        assert [w.pid for w in server.workers] == pids
