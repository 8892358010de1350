"""The torch engine's chunked prefill: a prompt prefilled in chunks over several steps, beside
decodes, gives the tokens of an unchunked prefill (greedy, and seeded sampling too)."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")

from cadence.engines.llama.engine import LlamaEngine
from cadence.vocabulary import AddRequest, Sampling
from cadence.worker.batch_scheduler import BatchScheduler
from cadence.worker.step_budget import FixedBudget
from tests.llama_models import hf_greedy, save_model, started_engine

N = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def engine(model_dir) -> LlamaEngine:
    return started_engine(model_dir, kv_cache_tokens=4096)


@pytest.fixture(autouse=True)
def no_cache_leak(engine):
    yield
    assert engine.cache.free_tokens == engine.cache.capacity_tokens


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    # Lengths that cross block boundaries (16) at odd places, and a short one.
    return [[0] + [rng.randrange(2, 300) for _ in range(n - 1)] for n in (200, 97, 33, 5)]


def run(
    engine: LlamaEngine, requests: list[AddRequest], budget: int | None, join_at: dict[int, int]
) -> dict[int, list[int]]:
    scheduler = BatchScheduler(engine, 0, 64, FixedBudget(budget) if budget else None)
    tokens: dict[int, list[int]] = defaultdict(list)
    pending = list(requests)
    step = 0
    while pending or scheduler.has_work:
        for r in [r for r in pending if join_at.get(r.seq_id, 0) <= step]:
            assert scheduler.add(r) is None
            pending.remove(r)
        out = scheduler.step()
        if out is not None:
            for seq_id, token in zip(out.seq_ids, out.token_ids):
                tokens[seq_id].append(token)
        step += 1
        assert step < 1000
    return dict(tokens)


@pytest.mark.parametrize("budget", [16, 23, 40])
def test_chunked_greedy_tokens_equal_unchunked_beside_decodes(engine, budget):
    ids = prompts()
    # The short ones start first and decode while the long ones are prefilled in chunks.
    requests = [AddRequest(i, p, N) for i, p in enumerate(ids)]
    join_at = {0: 2, 1: 3}
    whole = run(engine, requests, None, join_at)
    chunked = run(engine, requests, budget, join_at)
    assert chunked == whole
    assert all(len(t) == N or t[-1] == 1 for t in whole.values())


def test_chunked_greedy_tokens_equal_transformers(engine, model_dir):
    prompt = prompts()[0]
    got = run(engine, [AddRequest(7, prompt, N)], 16, {})
    assert got[7] == hf_greedy(model_dir, prompt, N)


def test_seeded_sampling_is_the_same_chunked_or_not(engine):
    ids = prompts()
    requests = [
        AddRequest(i, p, N, Sampling(temperature=0.9, top_k=20, seed=11 + i))
        for i, p in enumerate(ids)
    ]
    assert run(engine, requests, 24, {2: 1}) == run(engine, requests, None, {2: 1})


def test_a_sequence_cancelled_mid_prefill_gives_its_cache_back(engine):
    scheduler = BatchScheduler(engine, 0, 64, FixedBudget(32))
    free = engine.cache.free_tokens
    scheduler.add(AddRequest(1, prompts()[0], N))
    scheduler.step()
    assert engine.cache.free_tokens < free
    scheduler.abort([1])
    assert engine.cache.free_tokens == free
    assert scheduler.step() is None
