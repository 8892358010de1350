"""Priorities, preemption, prefix caching and prefix-aware routing over real sockets (the
synthetic engine), and the lab's reading of chunked prefill: long prompts named as stalling
the decodes without a step budget, not with --itl-target-ms."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import pytest

from cadence.client import AsyncClient, Client
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from tests.integration.conftest import start_server

SYSTEM = "You are a terse assistant for the cadence streaming server. " * 3


def ports(banner: str) -> dict[str, str]:
    return {
        kind: f"{host}:{port}"
        for kind, host, port in re.findall(r"(http|metrics) on (\S+):(\d+)", banner)
    }


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_turn_two_goes_to_turn_ones_worker_and_its_cached_tokens_are_reported():
    """Turn 1 and turn 2 of four conversations in turn, on two idle workers: routing by load
    alone would alternate them. The hit shows as cached_tokens on cadence.v1's last chunk,
    in OpenAI's usage and KServe's final response, and in the per-worker counters."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    np = pytest.importorskip("numpy")
    with start_server(
        "--devices",
        "cpu:2",
        "--step-ms",
        "2",
        "--prefix-caching",
        "--http-port",
        "0",
        "--metrics-port",
        "0",
    ) as server:
        found = ports(server.banner)
        cached = []
        with Client(server.target) as client:
            for conv in range(4):
                turn1 = f"{SYSTEM}Conversation {conv}: what is a token?"
                chunks = list(client.generate(turn1, max_tokens=20, include_timing=True))
                answer = "".join(c.text for c in chunks)
                turn2 = f"{turn1}{answer} And a step?"
                again = list(client.generate(turn2, max_tokens=5, include_timing=True))
                assert again[0].timing.worker == chunks[0].timing.worker, conv
                cached.append(again[-1].cached_tokens)
                assert all(c.cached_tokens == 0 for c in again[:-1])
        # Turn 2 holds turn 1's prompt and answer, whole blocks of 16 short of its last token.
        assert all(n >= 16 * ((len(SYSTEM) + 50) // 16) for n in cached), cached
        body = post(
            f"http://{found['http']}/v1/completions",
            {"model": "cadence", "prompt": turn2, "max_tokens": 3},
        )
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, body["usage"]
        responses = []
        kserve = grpcclient.InferenceServerClient(server.target)
        kserve.start_stream(callback=lambda result, error: responses.append((result, error)))
        prompt = grpcclient.InferInput("PROMPT", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([turn2.encode()], dtype=np.object_))
        limit = grpcclient.InferInput("MAX_TOKENS", [1], "INT32")
        limit.set_data_from_numpy(np.array([3], dtype=np.int32))
        kserve.async_stream_infer("cadence", [prompt, limit], priority=1)  # Triton's own
        kserve.stop_stream()
        final = responses[-1][0].get_response().parameters
        assert final["triton_final_response"].bool_param
        assert final["cached_tokens"].int64_param > 0
        metrics = urllib.request.urlopen(f"http://{found['metrics']}/metrics").read().decode()
    hits = dict(re.findall(r'cadence_prefix_cache_hits_total\{worker="(\d)"\} (\S+)', metrics))
    queries = re.findall(r'cadence_prefix_cache_queries_total\{worker="\d"\} (\S+)', metrics)
    assert sum(map(float, hits.values())) >= sum(cached) and sum(map(float, queries)) > 0


async def first_tokens(
    target: str, requests: list[tuple[float, dict]]
) -> list[tuple[float, float, list]]:
    """Each request (sent after its delay): its first and last chunk's arrival and chunks."""

    async def one(client: AsyncClient, delay: float, options: dict):
        await asyncio.sleep(delay)
        chunks, times = [], []
        async for chunk in client.generate(options.pop("prompt"), **options):
            chunks.append(chunk)
            times.append(time.monotonic())
        return times[0], times[-1], chunks

    async with AsyncClient(target) as client:
        return await asyncio.gather(*(one(client, d, dict(o)) for d, o in requests))


def test_a_waiting_high_priority_request_is_admitted_before_an_earlier_low_one(server_factory):
    server = server_factory("--devices", "cpu:1", "--max-batch", "1", "--step-ms", "5")
    busy, low, high = asyncio.run(
        first_tokens(
            server.target,
            [
                (0.0, {"prompt": "hold the only slot", "max_tokens": 40}),
                (0.05, {"prompt": "batch work", "max_tokens": 5, "priority": 5}),
                (0.10, {"prompt": "interactive", "max_tokens": 5, "priority": -5}),
            ],
        )
    )
    assert busy[1] < high[0] < low[0]


def test_a_preempted_stream_resumes_whole(server_factory):
    """The high-priority request preempts the low one in the only slot and ends first; the
    low one's stream just waits, then gives every token once, in order: those of its run
    alone."""
    server = server_factory("--devices", "cpu:1", "--max-batch", "1", "--step-ms", "5", "--preempt")
    low = {"prompt": "a long batch job", "max_tokens": 80, "priority": 1}
    preempted, urgent = asyncio.run(
        first_tokens(
            server.target,
            [(0.0, low), (0.15, {"prompt": "urgent", "max_tokens": 10, "priority": 0})],
        )
    )
    [(_, _, alone)] = asyncio.run(first_tokens(server.target, [(0.0, low)]))
    assert urgent[1] < preempted[1]
    chunks = preempted[2]
    assert [c.index for c in chunks] == [
        sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))
    ]
    assert [t for c in chunks for t in c.token_ids] == [t for c in alone for t in c.token_ids]


@pytest.mark.parametrize(
    "budget, named",
    [((), True), (("--itl-target-ms", "25"), False)],
    ids=["whole-prefill", "itl-target"],
)
def test_the_lab_names_long_prompts_stalling_decodes_only_without_a_budget(budget, named):
    with start_server(
        "--devices", "cpu:1", "--step-ms", "8", "--prefill-ms-per-token", "0.4", *budget
    ) as server:
        result = run_bench(
            server.target,
            Workload(
                requests=36,
                concurrency=12,
                shape=RequestShape(max_tokens=(20, 40), prompt_tokens=(16, 400)),
            ),
        )
    assert result.requests_ok == 36, result.errors_by_code
    fired = {f.rule: f.evidence for f in result.diagnosis}
    print(fired)
    assert ("prefill_stalls_decode" in fired) == named, fired


def test_the_torch_engine_serves_a_cached_prefix_with_the_tokens_it_computed(server_factory):
    """`--model tiny` (built from a seed): the same greedy request twice, the second from the
    prefix cache (its prompt's whole blocks but the last token's), gives the same tokens."""
    server = server_factory("--model", "tiny", "--prefix-caching", "--kv-cache-tokens", "2048")
    prompt = [(7 * i) % 250 + 3 for i in range(100)]
    with Client(server.target) as client:
        cold = list(client.generate(prompt, max_tokens=12))
        warm = list(client.generate(prompt, max_tokens=12))
    assert cold[-1].cached_tokens == 0 and warm[-1].cached_tokens == 96
    assert [t for c in warm for t in c.token_ids] == [t for c in cold for t in c.token_ids]
