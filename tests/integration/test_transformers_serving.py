"""End to end: `cadence serve --engine transformers --model DIR` (two workers) serving a tiny
random Gemma 2 checkpoint (sliding-window and global layers), over real gRPC and the OpenAI
HTTP front with the official `openai` client, against transformers' own generate."""

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
from tests.integration.test_openai import HttpServer
from tests.llama_models import PROMPTS
from tests.transformers_models import generate_greedy, save_checkpoint

openai = pytest.importorskip("openai")

N = 16
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = save_checkpoint(tmp_path_factory.mktemp("served") / "gemma2", "gemma2")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def server(folder) -> Iterator[HttpServer]:
    running = start_server(
        "--engine",
        "transformers",
        "--model",
        str(folder),
        "--devices",
        "cpu:2",
        "--served-model-name",
        "tiny",
        http=True,
    )
    yield running
    assert running.stop() == 0


async def _collect(target: str, prompt, **options) -> list:
    async with AsyncClient(target) as client:
        return [chunk async for chunk in client.generate(prompt, **options)]


def _tokens(chunks: list) -> list[int]:
    """The stream's token ids; indexes contiguous, only the last chunk finishes."""
    tokens: list[int] = []
    for chunk in chunks:
        assert chunk.index == len(tokens)
        tokens.extend(chunk.token_ids)
    assert [c.finish_reason for c in chunks[:-1]] == [0] * (len(chunks) - 1)
    return tokens


@pytest.mark.slow
def test_concurrent_streams_are_whole_and_equal_generate_on_two_workers(
    server, folder, tokenizer
) -> None:
    async def run() -> list[list]:
        return await asyncio.gather(
            *(_collect(server.target, p, max_tokens=N, include_timing=True) for p in PROMPTS * 3)
        )

    workers = set()
    for prompt, chunks in zip(PROMPTS * 3, asyncio.run(run())):
        ids = tokenizer(prompt).input_ids
        tokens = _tokens(chunks)
        assert tokens == generate_greedy(folder, ids, N), prompt
        assert "".join(c.text for c in chunks) == tokenizer.decode(tokens)
        assert chunks[0].prompt_tokens == len(ids)
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        workers |= {c.timing.worker for c in chunks}
    assert workers == {0, 1}


def test_a_cancelled_stream_leaves_the_others_whole(server, folder, tokenizer) -> None:
    ids = tokenizer(PROMPTS[0]).input_ids
    with Client(server.target) as client:
        for n, _ in enumerate(client.generate(PROMPTS[2], max_tokens=200)):
            if n == 3:
                break  # leaving the loop cancels the call
        assert _tokens(list(client.generate(ids, max_tokens=N))) == generate_greedy(folder, ids, N)
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate([5] * 300, max_tokens=N))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "context is 256" in err.value.details()


def test_the_openai_client_streams_completions_and_chat_with_the_template(
    server, folder, tokenizer
) -> None:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
    ids = tokenizer(PROMPTS[1]).input_ids
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[1],
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tokenizer.decode(generate_greedy(folder, ids, N))
    assert chunks[-1].usage.prompt_tokens == len(ids)

    messages = [{"role": "user", "content": "the lazy dog"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = list(getattr(chat_ids, "input_ids", chat_ids))
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    assert reply.usage.prompt_tokens == len(chat_ids)
    assert reply.choices[0].message.content == tokenizer.decode(
        generate_greedy(folder, chat_ids, 8)
    )
