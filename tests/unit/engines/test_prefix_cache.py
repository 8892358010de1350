"""Prefix caching: the torch engine's shared KV blocks give the greedy tokens of an uncached
run and report the tokens they served; the cache evicts what none holds, least recently
released first; the synthetic engine's model of it; the router's prefix index."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from cadence.config import EngineConfig, ServerConfig
from cadence.engines.llama.engine import LlamaEngine
from cadence.engines.llama.kv_cache import KVCache
from cadence.engines.synthetic import SyntheticEngine
from cadence.prefix_hash import block_hashes
from cadence.router.prefix_index import PrefixIndex, prompt_hashes
from cadence.router.worker_router import WorkerRouter, router_for
from cadence.transport.messages import AddRequest
from cadence.worker.batch_scheduler import BatchScheduler
from cadence.worker.step_budget import FixedBudget
from tests.llama_models import save_model, started_engine


def run(s: BatchScheduler, requests: list[AddRequest]) -> tuple[dict[int, list[int]], dict]:
    """Each request added once the previous one finished: tokens and reported cached_tokens."""
    tokens: dict[int, list[int]] = defaultdict(list)
    cached: dict[int, int] = {}
    for request in requests:
        assert s.add(request) is None
        while (out := s.step()) is not None:
            cached.update(out.cached_tokens)
            for seq_id, token in zip(out.seq_ids, out.token_ids):
                tokens[seq_id].append(token)
    return tokens, cached


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("llama") / "model", seed=7)


def engine(model_dir: Path, prefix_caching: bool, kv_tokens: int = 2048) -> LlamaEngine:
    return started_engine(
        model_dir, threads=1, kv_cache_tokens=kv_tokens, prefix_caching=prefix_caching
    )


def turns() -> list[AddRequest]:
    """A conversation's turns (each prompt extends the last) and a prompt that shares only
    its first 40 tokens with them; lengths off the 16-token blocks."""
    rng = random.Random(1)
    system = [0] + [rng.randrange(2, 300) for _ in range(70)]
    turn2 = system + [rng.randrange(2, 300) for _ in range(29)]
    other = system[:40] + [rng.randrange(2, 300) for _ in range(21)]
    return [
        AddRequest(1, system, 12),
        AddRequest(2, turn2, 12),
        AddRequest(3, system, 12),
        AddRequest(4, other, 12),
    ]


@pytest.mark.parametrize("budget", [None, 24], ids=["whole", "chunked"])
def test_a_cached_prefix_gives_the_tokens_of_an_uncached_prefill(model_dir, budget):
    plain, _ = run(BatchScheduler(engine(model_dir, False), 0, 8), turns())
    cache = engine(model_dir, True)
    s = BatchScheduler(cache, 0, 8, FixedBudget(budget) if budget else None, report_cached=True)
    tokens, cached = run(s, turns())
    assert tokens == plain
    # 71 tokens: 4 whole blocks known after turn 1; turn 2 (100 tokens) holds them; the same
    # prompt again holds all but the block of its last token; 40 shared tokens: 2 blocks.
    assert cached == {1: 0, 2: 64, 3: 64, 4: 32}
    assert cache.cache.free_tokens == cache.cache.capacity_tokens


def test_a_request_sharing_blocks_with_a_running_one_gets_its_tokens(model_dir):
    """Shared blocks are read-only: two sequences decoding on the same cached prefix at once
    give what each gives alone."""
    system, turn2 = turns()[0].prompt_token_ids, turns()[1].prompt_token_ids
    plain, _ = run(
        BatchScheduler(engine(model_dir, False), 0, 8),
        [AddRequest(1, system, 30), AddRequest(2, turn2, 30)],
    )
    s = BatchScheduler(engine(model_dir, True), 0, 8, report_cached=True)
    run(s, [AddRequest(9, system, 2)])
    for request in (AddRequest(1, system, 30), AddRequest(2, turn2, 30)):
        s.add(request)
    tokens: dict[int, list[int]] = defaultdict(list)
    while (out := s.step()) is not None:
        for seq_id, token in zip(out.seq_ids, out.token_ids):
            tokens[seq_id].append(token)
    assert tokens == plain


def kv(blocks: int) -> KVCache:
    return KVCache(
        layers=1,
        kv_heads=1,
        head_dim=1,
        capacity_tokens=16 * blocks,
        block_size=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_blocks_none_holds_stay_cached_until_evicted_least_recently_released_first():
    cache = kv(4)
    a, b = cache.allocate(32), cache.allocate(32)
    for block, h in zip(a + b, (b"a0", b"a1", b"b0", b"b1")):
        cache.register(block, h)
    cache.free(a)
    cache.free(b)
    assert cache.free_tokens == 64
    assert cache.match([b"a0", b"a1"]) == a  # held again: not evictable
    cache.free(a)
    # Two fresh blocks evict b's (released before a's was released again), tail first.
    assert cache.allocate(32) is not None
    assert cache.match([b"b0"]) == [] and len(cache.match([b"a0", b"a1"])) == 2


def test_the_synthetic_engine_skips_the_prefill_of_a_remembered_prefix():
    e = SyntheticEngine(EngineConfig(step_ms=0, prefill_ms_per_token=0, prefix_caching=True))
    s = BatchScheduler(e, 0, 8, report_cached=True)
    prompt = list(b"a shared system prompt that runs past two blocks...")
    tokens, cached = run(s, [AddRequest(1, prompt, 20), AddRequest(2, prompt, 20)])
    assert tokens[1] == tokens[2]
    assert cached == {1: 0, 2: 48}
    # The outputs are remembered too: the next turn holds the first turn's answer.
    turn2 = prompt + tokens[1] + list(b" and more")
    _, cached = run(s, [AddRequest(3, turn2, 2)])
    assert cached[3] == 64


def test_turn_two_is_routed_to_turn_ones_worker_unless_it_is_too_busy():
    router = WorkerRouter(3, PrefixIndex(3, 1000), slack=2)
    turn1 = prompt_hashes(list(range(100)), "", 100)
    turn2 = prompt_hashes(list(range(150)), "", 100)
    first = router.pick(turn1)
    router.assign(first, 10)
    # Without the prefix it would go to the next worker after the last one chosen.
    assert router.pick(turn2) == first
    router.assign(first, 10)
    router.assign(first, 10)  # 3 open requests, the others 0: past the slack of 2
    assert router.pick(turn2) != first


def test_text_prompts_are_indexed_by_their_bytes():
    assert prompt_hashes([], "x" * 130, 10) == block_hashes(b"x" * 130, 64, 10)


def test_prefix_routing_needs_prefix_caching_and_two_workers():
    on = EngineConfig(prefix_caching=True)
    assert router_for(ServerConfig(devices=["cpu", "cpu"], engine=on)).prefixes is not None
    assert router_for(ServerConfig(devices=["cpu", "cpu"])).prefixes is None
    assert router_for(ServerConfig(devices=["cpu"], engine=on)).prefixes is None
    assert (
        router_for(ServerConfig(devices=["cpu", "cpu"], engine=on, routing="load")).prefixes is None
    )
