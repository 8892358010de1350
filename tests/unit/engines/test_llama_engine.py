"""The torch engine stepped by the real BatchScheduler, against transformers on the same folder."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")

from cadence.engines.base import Sequence
from cadence.engines.llama.engine import LlamaEngine
from cadence.transport.messages import StepOutput
from cadence.vocabulary import AddRequest, Failure, Finish, Sampling
from cadence.worker.batch_scheduler import BatchScheduler
from tests.llama_models import PROMPTS, hf_greedy, save_model, started_engine

N = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer) -> list[list[int]]:
    return [hf_tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(model_dir, prompt_ids) -> list[list[int]]:
    return [hf_greedy(model_dir, ids, N) for ids in prompt_ids]


@pytest.fixture(scope="module")
def engine(model_dir) -> LlamaEngine:
    return started_engine(model_dir, kv_cache_tokens=4096)


@pytest.fixture(autouse=True)
def no_cache_leak(request):
    """Every test must leave the shared engine's cache as it found it: all blocks free."""
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        assert engine.cache.free_tokens == engine.cache.capacity_tokens


def run(
    engine: LlamaEngine,
    requests: list[AddRequest],
    join_at: dict[int, int] | None = None,
    max_batch: int = 64,
) -> tuple[dict[int, list[int]], list[StepOutput]]:
    """Step a scheduler until it has no work; request i joins at step join_at[seq_id] (default 0)."""
    join_at = join_at or {}
    scheduler = BatchScheduler(engine, 0, max_batch)
    tokens: dict[int, list[int]] = defaultdict(list)
    outputs = []
    pending = list(requests)
    step = 0
    while pending or scheduler.has_work:
        for r in [r for r in pending if join_at.get(r.seq_id, 0) <= step]:
            assert scheduler.add(r) is None
            pending.remove(r)
        out = scheduler.step()
        if out is not None:
            outputs.append(out)
            for seq_id, token in zip(out.seq_ids, out.token_ids):
                tokens[seq_id].append(token)
        step += 1
        assert step < 1000
    return dict(tokens), outputs


def test_greedy_tokens_equal_transformers_for_each_prompt_alone(engine, prompt_ids, expected):
    for i, ids in enumerate(prompt_ids):
        got, _ = run(engine, [AddRequest(i, ids, N)])
        assert got[i] == expected[i], f"prompt {PROMPTS[i]!r}"


def test_greedy_tokens_equal_transformers_in_a_mixed_length_batch(engine, prompt_ids, expected):
    requests = [AddRequest(i, ids, N) for i, ids in enumerate(prompt_ids)]
    together, outputs = run(engine, requests)
    assert [together[i] for i in range(len(PROMPTS))] == expected
    assert len(outputs[0].seq_ids) == len(PROMPTS), "all prompts were prefilled in one step"
    # Sequences joining while others decode, and leaving at different times.
    requests = [AddRequest(i, ids, N - 2 * i) for i, ids in enumerate(prompt_ids)]
    staggered, _ = run(engine, requests, join_at={0: 0, 1: 0, 2: 3, 3: 5})
    assert [staggered[i] for i in range(len(PROMPTS))] == [
        e[: N - 2 * i] for i, e in enumerate(expected)
    ]


@pytest.mark.slow
def test_a_sequences_tokens_do_not_depend_on_its_batch(engine, prompt_ids):
    greedy = AddRequest(100, prompt_ids[2], 16)
    sampled = AddRequest(
        101, prompt_ids[0], 16, Sampling(temperature=0.9, top_p=0.95, top_k=50, seed=7)
    )
    alone = {**run(engine, [greedy])[0], **run(engine, [sampled])[0]}
    others = [AddRequest(200 + i, ids, 3 + 4 * i) for i, ids in enumerate(prompt_ids)]
    others.append(AddRequest(210, prompt_ids[3], 9, Sampling(temperature=1.5, seed=1)))
    for join_at in ({}, {100: 2, 101: 5, 201: 4, 203: 7}, {200: 3, 202: 9, 210: 1}):
        mixed, _ = run(engine, [greedy, sampled, *others], join_at=join_at)
        assert mixed[100] == alone[100]
        assert mixed[101] == alone[101]


def test_text_prompts_are_tokenized_like_autotokenizer_and_detokenized_per_token(
    engine, hf_tokenizer, model_dir
):
    text = PROMPTS[2]
    tokens, outputs = run(engine, [AddRequest(5, [], N, prompt_text=text)])
    ids = hf_tokenizer(text).input_ids
    assert ids[0] == hf_tokenizer.bos_token_id, "AutoTokenizer adds BOS by default"
    assert outputs[0].prompt_lens == {5: len(ids)}
    assert tokens[5] == hf_greedy(model_dir, ids, N)
    pieces = [t for out in outputs for t in out.texts]
    assert len(pieces) == len(tokens[5])
    assert "".join(pieces) == hf_tokenizer.decode(tokens[5], skip_special_tokens=True)


def test_stop_at_eos_like_transformers(model_dir, prompt_ids):
    # Make EOS the first greedy token of one prompt: both must stop there.
    first = hf_greedy(model_dir, prompt_ids[1], 1)[0]
    folder = save_model(model_dir.parent / "eos", eos_token_id=first)
    engine = started_engine(folder, kv_cache_tokens=512)
    tokens, outputs = run(engine, [AddRequest(1, prompt_ids[1], N)])
    assert tokens[1] == [first] == hf_greedy(folder, prompt_ids[1], N)
    assert outputs[-1].finish_reasons == [Finish.STOP]


def test_cancelled_and_finished_sequences_free_their_cache_at_once(engine, prompt_ids):
    cache = engine.cache
    scheduler = BatchScheduler(engine, 0, 8)
    for i, ids in enumerate(prompt_ids):
        assert scheduler.add(AddRequest(i, ids, 40)) is None
    scheduler.step()
    held = cache.capacity_tokens - cache.free_tokens
    assert held == sum(cache.blocks_for(len(ids) + 39) for ids in prompt_ids) * cache.block_size
    scheduler.abort([2])
    assert (
        cache.capacity_tokens - cache.free_tokens
        == held - cache.blocks_for(len(prompt_ids[2]) + 39) * cache.block_size
    )
    scheduler.step()
    assert len(scheduler._running) == 3
    scheduler.abort([0, 1, 3])
    assert cache.free_tokens == cache.capacity_tokens


def test_admission_waits_for_cache_and_never_overfills_it(model_dir, prompt_ids, expected):
    # Room for one request at a time: the second waits in the queue, then runs correctly.
    engine = started_engine(model_dir, kv_cache_tokens=32)
    requests = [AddRequest(0, prompt_ids[0], N), AddRequest(1, prompt_ids[1], N)]
    tokens, outputs = run(engine, requests)
    assert tokens == {0: expected[0], 1: expected[1]}
    assert all(len(out.seq_ids) == 1 for out in outputs)
    assert engine.cache.free_tokens == engine.cache.capacity_tokens


def test_check_refuses_requests_that_cannot_run_with_the_reason(model_dir):
    engine = started_engine(model_dir, kv_cache_tokens=64)
    assert engine.check(Sequence(AddRequest(0, [5, 6], 10))) is None
    assert "context of 256" in engine.check(Sequence(AddRequest(0, [5] * 250, 10)))
    assert "--kv-cache-tokens" in engine.check(Sequence(AddRequest(0, [5] * 60, 10)))
    assert "must be in [0, " in engine.check(Sequence(AddRequest(0, [5, 100_000], 10)))
    scheduler = BatchScheduler(engine, 0, 8)
    failure = scheduler.add(AddRequest(9, [5] * 250, 10))
    assert failure is not None and failure.failure == Failure.INVALID_ARGUMENT


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(engine, prompt_ids, expected):
    def sampled(seed: int, **kw) -> list[int]:
        sampling = Sampling(temperature=kw.pop("temperature", 1.0), seed=seed, **kw)
        request = AddRequest(1, prompt_ids[0], N, sampling)
        return run(engine, [request])[0][1]

    assert sampled(3) == sampled(3)
    assert sampled(3) != sampled(4)
    assert sampled(5, top_k=1) == expected[0]
    assert sampled(5, top_p=1e-6) == expected[0]


def test_start_up_measures_a_cold_and_a_warm_step(engine):
    assert engine.first_step_ms > 0 and engine.warm_step_ms > 0


def test_a_burst_of_long_prompts_is_prefilled_over_several_steps(model_dir):
    from cadence.engines.llama.engine import PREFILL_BUDGET

    engine = started_engine(model_dir, kv_cache_tokens=16384)
    scheduler = BatchScheduler(engine, 0, 64)
    for i in range(30):
        assert scheduler.add(AddRequest(i, [0] + [7 + i] * 199, 2)) is None
    first = scheduler.step()
    assert len(first.seq_ids) == PREFILL_BUDGET // 200
    while scheduler.has_work:
        scheduler.step()
    assert engine.cache.free_tokens == engine.cache.capacity_tokens
