"""End to end: an `--app` function and a batched model class that bring their own tokenizer
(a `tokenizers` BPE built locally, tests/bpe_served.py) stream ids of their vocabulary (above
255) and exact text over cadence.v1, KServe and OpenAI: prompt ids in, output ids out, text
prompts tokenized by their tokenizer and counted by it in `usage`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cadence.client import Client
from cadence.proto.v1 import inference_pb2 as pb
from tests.bpe_served import BOS, BPE
from tests.integration.test_openai import HttpServer, start_http

openai = pytest.importorskip("openai")
grpcclient = pytest.importorskip("tritonclient.grpc")
np = pytest.importorskip("numpy")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "héllo wörld 你好, the lazy dog"
"""Split multi-byte characters (你好 is several byte-level tokens) and merged words."""
MAX_PROMPT = 600
"""PROMPT x 30 is 601 tokens of the BPE (1,020 bytes)."""
SERVES = {
    "app": ("--app", "tests.bpe_served:echo_ids"),
    "model": ("--engine", "tests.bpe_served:EchoIdsModel"),
}


@pytest.fixture(scope="module", params=sorted(SERVES))
def server(request) -> Iterator[HttpServer]:
    with pytest.MonkeyPatch.context() as mp:  # the workers import tests.bpe_served
        mp.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        )
        mp.chdir(ROOT)
        running = start_http(
            *SERVES[request.param],
            "--served-model-name",
            "bpe",
            "--max-prompt-tokens",
            str(MAX_PROMPT),
        )
    yield running
    assert running.stop() == 0


def _expected(prompt_ids: list[int], count: int) -> list[int]:
    ids = [t for t in prompt_ids if t != BOS]
    return [ids[i % len(ids)] for i in range(count)]


def _tokens(chunks: list) -> list[int]:
    """The stream's ids; indexes contiguous (in outputs: a text piece of several ids is one),
    only the last chunk finishes."""
    tokens: list[int] = []
    position = 0
    for chunk in chunks:
        assert chunk.index == position
        tokens.extend(chunk.token_ids)
        position += chunk.outputs or len(chunk.token_ids)
    assert [c.finish_reason for c in chunks[:-1]] == [0] * (len(chunks) - 1)
    return tokens


def test_cadence_v1_text_and_id_prompts(server) -> None:
    ids = BPE.encode(PROMPT).ids
    assert max(ids) > 255 and ids[0] == BOS
    with Client(server.target) as client:
        count = 2 * (len(ids) - 1)
        chunks = list(client.generate(PROMPT, max_tokens=count))
        tokens = _tokens(chunks)
        assert tokens == _expected(ids, count)
        assert "".join(c.text for c in chunks) == BPE.decode(tokens) == PROMPT + PROMPT
        assert chunks[0].prompt_tokens == len(ids)  # counted by the function's tokenizer
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH

        chunks = list(client.generate(ids[1:], max_tokens=len(ids) - 1))  # ids in
        assert _tokens(chunks) == ids[1:]
        assert "".join(c.text for c in chunks) == PROMPT

        # str pieces: encoded by the tokenizer, without the BOS a prompt gets.
        chunks = list(client.generate("say: the lazy dog", max_tokens=20))
        tokens = _tokens(chunks)
        assert "".join(c.text for c in chunks) == "the lazy dog "
        assert tokens == [
            t
            for word in ("the ", "lazy ", "dog ")
            for t in BPE.encode(word, add_special_tokens=False).ids
        ]
        assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP

        with pytest.raises(grpc.RpcError) as info:
            list(client.generate([5, BPE.get_vocab_size()], max_tokens=4))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"must be in [0, {BPE.get_vocab_size()})" in info.value.details()


def test_a_text_prompt_over_the_limit_is_refused(server) -> None:
    """Tokenized by the front (the app's bytes) or by the worker (the model's tokenizer), a
    prompt over --max-prompt-tokens ends INVALID_ARGUMENT naming the flag."""
    long = PROMPT * 30
    assert len(BPE.encode(long).ids) > MAX_PROMPT
    with Client(server.target) as client, pytest.raises(grpc.RpcError) as info:
        list(client.generate(long, max_tokens=2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_PROMPT} (--max-prompt-tokens)" in info.value.details()


def test_kserve_ids_in_and_out(server) -> None:
    ids = BPE.encode(PROMPT).ids[1:]
    client = grpcclient.InferenceServerClient(server.target)
    prompt = grpcclient.InferInput("PROMPT_TOKEN_IDS", [len(ids)], "INT32")
    prompt.set_data_from_numpy(np.array(ids, dtype=np.int32))
    limit = grpcclient.InferInput("MAX_TOKENS", [1], "INT32")
    limit.set_data_from_numpy(np.array([len(ids)], dtype=np.int32))
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        client.async_stream_infer("bpe", [prompt, limit], request_id="r")
    finally:
        client.stop_stream()  # returns once every response has arrived
        client.close()
    assert [error for _, error in results if error is not None] == []
    tokens = [int(t) for result, _ in results for t in result.as_numpy("TOKEN_IDS")]
    assert tokens == ids
    text = b"".join(result.as_numpy("TEXT")[0] for result, _ in results)
    assert text.decode() == PROMPT


def test_openai_completions_text_ids_and_usage(server) -> None:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
    ids = BPE.encode(PROMPT).ids
    chunks = list(
        client.completions.create(
            model="bpe",
            prompt=PROMPT,
            max_tokens=len(ids) - 1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(ids) - 1)

    whole = client.completions.create(model="bpe", prompt=ids[1:], max_tokens=len(ids) - 1)
    assert whole.choices[0].text == PROMPT
    assert whole.usage.prompt_tokens == len(ids) - 1
