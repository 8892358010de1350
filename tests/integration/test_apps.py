"""End to end: users' generator functions (tests/apps.py) served by real `cadence serve --app`
processes, sync and async, checked token by token."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cadence.byte_tokenizer import ByteTokenizer
from cadence.client import AsyncClient, Client
from cadence.proto.v1 import inference_pb2 as pb
from tests.integration.conftest import RunningServer, runs_once, serve_refused, start_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def importable_apps() -> Iterator[None]:
    """Servers and their workers import `tests.apps` from the repository root."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        )
        mp.chdir(ROOT)
        yield


@pytest.fixture(scope="module")
def sync_server(importable_apps) -> Iterator[RunningServer]:
    running = start_server("--app", "tests.apps:sync_app", "--engine-threads", "2")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def async_server(importable_apps) -> Iterator[RunningServer]:
    running = start_server("--app", "tests.apps:async_app")
    yield running
    assert running.stop() == 0


def _tokens(chunks: list) -> list[int]:
    """Indexes are contiguous, only the last chunk finishes; returns every token."""
    tokens: list[int] = []
    for chunk in chunks:
        assert chunk.index == len(tokens)
        tokens.extend(chunk.token_ids)
    assert [c.finish_reason for c in chunks[:-1]] == [0] * (len(chunks) - 1)
    assert "".join(c.text for c in chunks) == ByteTokenizer().decode(tokens)
    return tokens


async def _collect(target: str, prompt: str, max_tokens: int, **options) -> list:
    async with AsyncClient(target) as client:
        return [c async for c in client.generate(prompt, max_tokens=max_tokens, **options)]


async def _many(target: str, prompts: list[tuple[str, int]]) -> list:
    return await asyncio.gather(
        *(_collect(target, p, n) for p, n in prompts), return_exceptions=True
    )


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_concurrent_streams_have_contiguous_index_and_the_right_finish(kind, request) -> None:
    server = request.getfixturevalue(f"{kind}_server")
    results = asyncio.run(_many(server.target, [("count 30", 100)] * 12 + [("count 30", 7)] * 4))
    for chunks in results[:12]:
        assert _tokens(chunks) == list(b"012345678901234567890123456789")
        assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP  # the function returned
    for chunks in results[12:]:
        assert _tokens(chunks) == list(b"0123456")
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_text_and_token_id_pieces(sync_server) -> None:
    with Client(sync_server.target) as client:
        chunks = list(client.generate("multi", max_tokens=100))
    assert _tokens(chunks) == list("héllo wörld ".encode()) + [65, 66, 67]
    assert "".join(c.text for c in chunks) == "héllo wörld ABC"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_exception_ends_only_its_stream_with_internal(kind, request) -> None:
    server = request.getfixturevalue(f"{kind}_server")
    failed, ok = asyncio.run(_many(server.target, [("fail", 50), ("count 40", 50)]))
    assert isinstance(failed, grpc.aio.AioRpcError)
    assert failed.code() == grpc.StatusCode.INTERNAL
    error = "ValueError" if kind == "sync" else "RuntimeError"
    assert error in failed.details() and "failed on purpose" in failed.details()
    assert len(_tokens(ok)) == 40


def _wait_for_lines(path: Path, expected: list[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().splitlines() == expected):
        assert time.monotonic() < deadline, (
            f"{path} holds {path.read_text() if path.exists() else None!r}"
        )
        time.sleep(0.02)


def test_client_cancel_reaches_a_sync_function(sync_server, tmp_path) -> None:
    record = tmp_path / "sync.txt"
    with Client(sync_server.target) as client:
        for n, _ in enumerate(client.generate(f"record {record}", max_tokens=1000)):
            if n == 3:
                break  # leaving the loop cancels the call
    _wait_for_lines(record, ["closed cancelled=True"])


def test_client_cancel_reaches_an_async_function(async_server, tmp_path) -> None:
    record = tmp_path / "async.txt"
    with Client(async_server.target) as client:
        for n, _ in enumerate(client.generate(f"record {record}", max_tokens=1000)):
            if n == 3:
                break
    _wait_for_lines(record, ["cancelled context.cancelled=True"])


def test_a_deadline_reaches_the_function(sync_server, tmp_path) -> None:
    record = tmp_path / "deadline.txt"
    with Client(sync_server.target) as client, pytest.raises(grpc.RpcError) as info:
        list(client.generate(f"record {record}", max_tokens=10**4, timeout=0.3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for_lines(record, ["closed cancelled=True"])


def test_a_blocked_request_does_not_stall_the_others(sync_server) -> None:
    async def run() -> None:
        async with AsyncClient(sync_server.target) as client:
            blocked = client.generate("block", max_tokens=10)
            first = await blocked.__anext__()
            assert first.text == "blocked "  # the function now holds one of the 2 threads
            others = await asyncio.wait_for(_many(sync_server.target, [("count 20", 20)] * 6), 20)
            for chunks in others:
                assert len(_tokens(chunks)) == 20
            await blocked.aclose()  # cancels it; the function's wait returns

    asyncio.run(run())


def _peaks(target: str) -> set[int]:
    """Every piece says how many pieces ran at once in the worker when it started."""
    results = asyncio.run(_many(target, [("overlap 8", 8)] * 4))
    return {t for chunks in results for t in _tokens(chunks)}


def test_one_engine_thread_runs_one_piece_at_a_time_and_two_overlap(
    sync_server, importable_apps
) -> None:
    one = start_server("--app", "tests.apps:sync_app", "--engine-threads", "1")
    try:
        assert _peaks(one.target) == {1}
    finally:
        assert one.stop() == 0
    assert max(_peaks(sync_server.target)) == 2


def test_app_in_front_runs_in_the_front_process(importable_apps) -> None:
    server = start_server("--app", "tests.apps:pid_app", "--app-in-front", "--devices", "cpu:2")
    try:
        assert server.workers == [], "no worker process"
        with Client(server.target) as client:
            texts = {client.complete("x", max_tokens=50) for _ in range(4)}
        assert texts == {f"{server.front.pid} cpu cpu"}
    finally:
        assert server.stop() == 0


@runs_once
def test_serve_from_python_starts_workers_and_stops_on_sigterm(importable_apps) -> None:
    code = (
        "import cadence\nfrom tests.apps import pid_app\n"
        "cadence.serve(pid_app, devices='cpu:2', port=0, max_concurrent=8)\n"
    )
    server = start_server(command=[sys.executable, "-c", code])
    try:
        with Client(server.target) as client:
            pids = {int(client.complete("x", max_tokens=50).split()[0]) for _ in range(4)}
        assert pids <= {w.pid for w in server.workers} and server.pid not in pids
    finally:
        assert server.stop() == 0


def test_an_app_that_cannot_be_imported_fails_the_start(importable_apps) -> None:
    out = serve_refused("--startup-timeout", "20", "--app", "tests.apps:no_such_function")
    assert out.returncode != 0
    assert "cannot load app 'tests.apps:no_such_function'" in out.stderr
    assert "AttributeError" in out.stderr
