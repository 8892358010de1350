"""The padded, static-shape decode steps that CUDA graphs replay, run eagerly on the CPU.

The graphs themselves need a GPU (benchmarks/gpu_check.py checks them there); what they
replay is this padding: batches rounded up to a bucket, padding rows writing only to a
scratch block, unused cache columns masked. Here it must give the eager path's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")

from cadence.engines.base import Sequence
from cadence.engines.llama.decode_graphs import DecodeGraphs
from cadence.vocabulary import AddRequest
from tests.llama_models import PROMPTS, hf_greedy, save_model, started_engine
from tests.unit.engines.test_llama_engine import N, run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("llama-graphs") / "model")


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p).input_ids for p in PROMPTS]


def padded_engine(model_dir: Path, max_batch: int):
    engine = started_engine(model_dir, kv_cache_tokens=4096)
    engine.graphs = DecodeGraphs(engine.model, engine.cache, max_batch=max_batch, capture=False)
    return engine


def test_padded_decode_gives_transformers_tokens_across_buckets(model_dir, prompt_ids):
    # Four prompts joining and leaving at different steps: batches of 1 to 4 sequences, each
    # padded to the next bucket (1, 2, 4), and widths that cross a block boundary.
    engine = padded_engine(model_dir, max_batch=4)
    requests = [AddRequest(i, ids, N + 8 - 2 * i) for i, ids in enumerate(prompt_ids)]
    tokens, _ = run(engine, requests, join_at={0: 0, 1: 2, 2: 4, 3: 7})
    for i, ids in enumerate(prompt_ids):
        assert tokens[i] == hf_greedy(model_dir, ids, N + 8 - 2 * i), f"prompt {PROMPTS[i]!r}"
    assert engine.graphs.replays > 0
    assert {batch for batch, _ in engine.graphs.shapes} == {1, 2, 4}
    assert engine.cache.free_tokens == engine.cache.capacity_tokens


def test_padding_rows_write_only_to_the_scratch_block(model_dir, prompt_ids):
    engine = padded_engine(model_dir, max_batch=8)
    graphs, cache = engine.graphs, engine.cache
    before = [k.clone() for k in cache.keys]
    scratch = graphs.scratch_block * cache.block_size
    # Three sequences decode in a bucket of four: one padding row per step.
    run(engine, [AddRequest(i, ids, 6) for i, ids in enumerate(prompt_ids[:3])])
    assert {batch for batch, _ in graphs.shapes} == {4}
    for old, new in zip(before, cache.keys):
        changed = (old != new).any(dim=(1, 2)).nonzero().flatten().tolist()
        held = [s for s in changed if not scratch <= s < scratch + cache.block_size]
        # Real sequences wrote their own slots; no write landed in a block nobody held.
        assert len(held) == sum(len(ids) + 5 for ids in prompt_ids[:3])
    assert (cache.keys[0][scratch] != 0).any(), "the padding row wrote its scratch slot"


def test_the_scratch_block_is_out_of_the_cache_capacity(model_dir):
    engine = started_engine(model_dir, kv_cache_tokens=64)
    capacity = engine.cache.capacity_tokens
    DecodeGraphs(engine.model, engine.cache, max_batch=4, capture=False)
    assert engine.cache.capacity_tokens == capacity - engine.cache.block_size
    assert engine.cache.free_tokens == engine.cache.capacity_tokens
    assert "--kv-cache-tokens" in engine.check(Sequence(AddRequest(0, [5] * 40, 10)))


def test_steps_that_do_not_fit_a_bucket_run_eagerly(model_dir, prompt_ids):
    engine = padded_engine(model_dir, max_batch=2)
    tokens, _ = run(engine, [AddRequest(i, ids, N) for i, ids in enumerate(prompt_ids)])
    # Four sequences decode together: beyond the largest bucket (2), so no bucket was used.
    assert engine.graphs.replays == 0
    assert tokens[0] == hf_greedy(model_dir, prompt_ids[0], N)


def test_cuda_graphs_are_off_on_the_cpu(model_dir):
    assert started_engine(model_dir, kv_cache_tokens=256).graphs is None
