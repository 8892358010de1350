"""An OpenAI server that streams its reasoning apart from its answer (`delta.reasoning_content`,
as vLLM and SGLang send it, or `delta.reasoning`), planted on 127.0.0.1: the lab times the first
reasoning output and the first answer apart, and with `--tokenizer` counts the prompt in the
tokenizer's tokens."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import msgspec
import pytest

from cadence.lab.results import BenchResult
from tests.integration.test_bench_honest import bench

THINK_MS = 30
"""The planted server's pause between its reasoning and its answer."""


@pytest.fixture(scope="module")
def reasoning_server() -> Iterator[str]:
    """http://HOST:PORT of a server that streams 3 reasoning deltas, then 4 answer deltas."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        field = "reasoning" if body.get("model") == "plain-reasoning" else "reasoning_content"
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)

        async def event(
            delta: dict | None, usage: dict | None = None, finish: str | None = None
        ) -> None:
            chunk = {
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
                if delta is not None
                else []
            }
            if usage:
                chunk["usage"] = usage
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await event({"role": "assistant"})
        for word in ("let", "me", "think"):
            await event({field: word + " "})
            await asyncio.sleep(0.002)
        await asyncio.sleep(THINK_MS / 1e3)
        for word in ("the", "answer", "is", "four"):
            await event({"content": word + " "}, finish="stop" if word == "four" else None)
            await asyncio.sleep(0.002)
        await event(None, {"prompt_tokens": 99, "completion_tokens": 7})
        await out.write(b"data: [DONE]\n\n")
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.mark.parametrize("model", ["vllm-style", "plain-reasoning"])
def test_first_reasoning_and_first_answer_are_timed_apart(
    reasoning_server, tmp_path, model
) -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(".."), behavior="isolated")
    tokenizer.save(str(tmp_path / "tokenizer.json"))  # a token is two characters
    out = tmp_path / "run.json"
    done = bench(
        "--target",
        reasoning_server,
        "--protocol",
        "openai",
        "--endpoint",
        "chat",
        "--model",
        model,
        "--concurrency",
        "4",
        "--requests",
        "8",
        "--prompt-tokens",
        "40",
        "--max-tokens",
        "8",
        "--tokenizer",
        str(tmp_path),
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    result = msgspec.convert(json.loads(out.read_text()), BenchResult)
    thought, answer = result.ttft_reasoning_ms, result.ttft_answer_ms
    assert thought.count == answer.count == 8
    assert answer.p50 >= thought.p50 + THINK_MS * 0.9
    assert result.ttft_ms.p50 == pytest.approx(thought.p50)
    # Reasoning is output: 7 events, 32 characters, 16 of the tokenizer's tokens.
    assert all(r.output_tokens == 16 and len(r.tokens) == 7 for r in result.records)
    # The prompt counted in the tokenizer's tokens: 40 characters, 20 tokens.
    assert {r.prompt_tokens for r in result.records} == {20}
    assert "first reasoning output p50" in done.stdout and "first answer output" in done.stdout
