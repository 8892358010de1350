"""End to end: `cadence serve --engine torch --model PATH` serving a tiny random Llama saved by
transformers, streamed over gRPC and checked against transformers' greedy tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")

from cadence.client import AsyncClient, Client
from cadence.proto.v1 import inference_pb2 as pb
from tests.integration.conftest import start_server
from tests.llama_models import PROMPTS, hf_greedy, save_model

N = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("served") / "model")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def torch_server(model_dir) -> Iterator:
    running = start_server(
        "--engine", "torch", "--model", str(model_dir), "--kv-cache-tokens", "2048"
    )
    yield running
    assert running.stop() == 0


async def _collect(target: str, prompt, **options) -> list:
    async with AsyncClient(target) as client:
        return [chunk async for chunk in client.generate(prompt, **options)]


def _tokens(chunks: list) -> list[int]:
    tokens: list[int] = []
    for chunk in chunks:
        assert chunk.index == len(tokens)
        tokens.extend(chunk.token_ids)
    return tokens


def test_text_prompts_stream_transformers_greedy_tokens_and_text(
    torch_server, model_dir, hf_tokenizer
):
    async def run() -> list[list]:
        return await asyncio.gather(
            *(_collect(torch_server.target, p, max_tokens=N) for p in PROMPTS)
        )

    for prompt, chunks in zip(PROMPTS, asyncio.run(run())):
        ids = hf_tokenizer(prompt).input_ids
        tokens = _tokens(chunks)
        assert tokens == hf_greedy(model_dir, ids, N), prompt
        assert chunks[0].prompt_tokens == len(ids), "the worker counted the prompt's tokens"
        assert "".join(c.text for c in chunks) == hf_tokenizer.decode(
            tokens, skip_special_tokens=True
        )
        assert chunks[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)


def test_token_id_prompts_and_engine_refusals(torch_server, model_dir):
    ids = [0, 17, 42, 99, 5]
    with Client(torch_server.target) as client:
        chunks = list(client.generate(ids, max_tokens=N))
        assert _tokens(chunks) == hf_greedy(model_dir, ids, N)
        assert chunks[0].prompt_tokens == len(ids)
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate([5] * 250, max_tokens=N))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "context of 256" in err.value.details()


@pytest.mark.slow
def test_tensor_parallel_replicas_serve_the_same_tokens(model_dir, hf_tokenizer):
    # Two replicas of two gloo ranks each: four worker processes, all gone after stop.
    running = start_server(
        "--engine",
        "torch",
        "--model",
        str(model_dir),
        "--devices",
        "cpu:4",
        "--tp",
        "2",
        "--kv-cache-tokens",
        "1024",
    )
    try:
        assert len(running.workers) == 4

        async def run() -> list[list]:
            return await asyncio.gather(
                *(_collect(running.target, p, max_tokens=N) for p in PROMPTS * 2)
            )

        for prompt, chunks in zip(PROMPTS * 2, asyncio.run(run())):
            ids = hf_tokenizer(prompt).input_ids
            assert _tokens(chunks) == hf_greedy(model_dir, ids, N), prompt
            assert {c.timing.worker for c in chunks} <= {0, 1}
    finally:
        assert running.stop() == 0
