"""The HTTP front against hostile or unlucky clients, from outside over real sockets: values
msgpack cannot hold, nesting bombs, malformed HTTP, slow and stalled readers. Each test names
the fault it guards against (issue 25)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from tests.integration.test_openai import HttpServer, _BANNER, _get

MODEL = "tiny-m"


def start_logged(log: Path, *args: str) -> HttpServer:
    """`cadence serve` with an HTTP port and its stderr (the log) in `log`, once healthy."""
    process = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "serve", "--port", "0", "--http-port", "0",
         "--served-model-name", MODEL, *args],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = process.stdout.readline()
    match = _BANNER.search(line)
    if not match:
        process.kill()
        raise RuntimeError(f"server did not start (exit {process.wait()}): {log.read_text()}")
    server = HttpServer(process, f"{match.group(1)}:{match.group(2)}",
                        psutil.Process(process.pid).children(recursive=True))
    server.base = f"http://{match.group(3)}:{match.group(4)}"
    deadline = time.monotonic() + 60
    while _get(server.base + "/health")[0] != 200:
        assert time.monotonic() < deadline and process.poll() is None, log.read_text()
        time.sleep(0.05)
    return server


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Iterator[tuple[HttpServer, Path]]:
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    server = start_logged(log, "--devices", "cpu:1", "--step-ms", "5", "--max-concurrent",
                          "64", "--log-level", "INFO")
    yield server, log
    assert server.stop() == 0


async def _burst(base: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    """Every body POSTed to /v1/completions at once; (status, JSON body) of each, or
    (0, {}) for one that got no answer within 10 s."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async def one(body: dict) -> tuple[int, dict]:
            try:
                async with session.post(base + "/v1/completions", json=body) as response:
                    return response.status, json.loads(await response.read())
            except (TimeoutError, aiohttp.ClientError):
                return 0, {}

        return await asyncio.gather(*map(one, bodies))


@pytest.mark.parametrize("field, value, param", [
    ("seed", 2 ** 64, "seed"),
    ("seed", -(2 ** 63) - 1, "seed"),
    ("stop_token_ids", [2 ** 70], "stop_token_ids"),
    ("prompt", [1, 2 ** 70], "prompt"),
])
def test_an_out_of_range_integer_fails_only_its_own_request(logged, field, value,
                                                             param) -> None:
    server, _ = logged
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    bodies = [dict(good) for _ in range(20)]
    bodies.insert(7, {**good, field: value})
    answers = asyncio.run(_burst(server.base, bodies))
    status, body = answers.pop(7)
    assert status == 400, body
    assert body["error"]["param"] == param and param in body["error"]["message"]
    assert [s for s, _ in answers] == [200] * 20
    # Nothing was left holding an admission slot: a full house is admitted again.
    again = asyncio.run(_burst(server.base, [good] * 64))
    assert [s for s, _ in again] == [200] * 64


def test_seed_at_the_edges_of_64_bits_is_served(logged) -> None:
    server, _ = logged
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    answers = asyncio.run(_burst(server.base, [{**good, "seed": 2 ** 64 - 1},
                                               {**good, "seed": -(2 ** 63)}]))
    assert [s for s, _ in answers] == [200, 200], answers


def _post_raw(base: str, body: bytes) -> tuple[int, dict]:
    async def run() -> tuple[int, dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.post(base + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as response:
                return response.status, json.loads(await response.read())

    return asyncio.run(run())


def test_a_nesting_bomb_is_a_400_not_a_traceback(logged) -> None:
    server, log = logged
    depth = 100_000
    for bomb in (b'{"model":"tiny-m","prompt":' + b"[" * depth + b"]" * depth + b"}",
                 b"[" * depth + b"]" * depth):
        status, body = _post_raw(server.base, bomb)
        assert status == 400, body
        assert body["error"]["type"] == "invalid_request_error" and "deep" in body["error"]["message"]
    assert "Traceback" not in log.read_text()
