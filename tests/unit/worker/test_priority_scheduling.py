"""Priorities and --preempt in the BatchScheduler: admission by priority (lower first, FCFS
within one), and a preempted sequence that resumes whole, on the synthetic engine (no
sleeps) and on the torch engine's paged KV cache (a tiny random Llama, greedy)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from cadence.config import EngineConfig
from cadence.engines.llama.engine import LlamaEngine
from cadence.engines.synthetic import SyntheticEngine
from cadence.transport.messages import AddRequest
from cadence.worker.batch_scheduler import BatchScheduler
from cadence.worker.step_budget import FixedBudget
from tests.llama_models import save_model, started_engine

PROMPT = list(b"Hello, cadence")


def synthetic(**config) -> SyntheticEngine:
    return SyntheticEngine(EngineConfig(step_ms=0, prefill_ms_per_token=0, **config))


def drive(
    s: BatchScheduler, joins: dict[int, list[AddRequest]]
) -> tuple[dict[int, list[int]], list[int]]:
    """Step until done, adding `joins[step]` before each step: each sequence's tokens, and the
    order in which sequences gave their first token."""
    tokens: dict[int, list[int]] = defaultdict(list)
    firsts: list[int] = []
    step = 0
    while s.has_work or any(k >= step for k in joins):
        for request in joins.get(step, []):
            assert s.add(request) is None
        out = s.step()
        step += 1
        if out is None:
            continue
        for seq_id, token in zip(out.seq_ids, out.token_ids):
            if not tokens[seq_id]:
                firsts.append(seq_id)
            tokens[seq_id].append(token)
        assert step < 10_000
    return tokens, firsts


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = BatchScheduler(synthetic(), 0, max_batch=1)
    joins = {
        0: [
            AddRequest(1, PROMPT, 3, priority=5),
            AddRequest(2, PROMPT, 3, priority=5),
            AddRequest(3, PROMPT, 3, priority=-2),
            AddRequest(4, PROMPT, 3),
            AddRequest(5, PROMPT, 3, priority=-2),
        ]
    }
    _, firsts = drive(s, joins)
    assert firsts == [3, 5, 4, 1, 2]


def test_without_preempt_a_high_priority_request_waits_for_a_slot():
    s = BatchScheduler(synthetic(), 0, max_batch=1)
    _tokens, firsts = drive(
        s, {0: [AddRequest(1, PROMPT, 20, priority=3)], 5: [AddRequest(2, PROMPT, 4, priority=0)]}
    )
    assert firsts == [1, 2] and s.preemptions == 0


@pytest.mark.parametrize("budget", [None, FixedBudget(8)], ids=["whole", "chunked"])
def test_a_preempted_sequence_resumes_whole(budget):
    """The high-priority request takes the only slot at once; the low one goes on after it
    with exactly the tokens it would have given alone (none lost, none repeated)."""
    alone, _ = drive(
        BatchScheduler(synthetic(), 0, 1, budget), {0: [AddRequest(1, PROMPT, 30, priority=3)]}
    )
    s = BatchScheduler(synthetic(), 0, 1, budget, preempt=True)
    tokens, _ = drive(
        s,
        {
            0: [AddRequest(1, PROMPT, 30, priority=3)],
            12: [AddRequest(2, list(b"urgent"), 5, priority=-1)],
        },
    )
    assert s.preemptions == 1
    assert tokens[1] == alone[1] and len(tokens[2]) == 5


def test_only_a_lower_priority_sequence_is_preempted():
    s = BatchScheduler(synthetic(), 0, 1, preempt=True)
    _, firsts = drive(
        s, {0: [AddRequest(1, PROMPT, 10, priority=0)], 3: [AddRequest(2, PROMPT, 3, priority=0)]}
    )
    assert firsts == [1, 2] and s.preemptions == 0


@pytest.mark.parametrize("budget", [None, FixedBudget(8)], ids=["whole", "chunked"])
@pytest.mark.parametrize("paused_when", ["running", "waiting"])
def test_a_paused_sequence_stays_paused_across_a_preemption(budget, paused_when):
    """--overflow block: a sequence paused while it runs, or whose pause arrives while it
    waits preempted, gives at most its re-prefill's output when admitted again, then nothing
    until resumed; the worker then has no work (the paused sequence is not work)."""
    s = BatchScheduler(synthetic(), 0, 1, budget, preempt=True)
    assert s.add(AddRequest(1, PROMPT, 50, priority=3)) is None
    for _ in range(3):
        s.step()
    if paused_when == "running":
        s.pause([1])
    assert s.add(AddRequest(2, list(b"urgent"), 4, priority=0)) is None
    s.step()  # 2 preempts 1
    assert s.preemptions == 1
    if paused_when == "waiting":
        s.pause([1])
    given = []
    while s.has_work:
        out = s.step()
        given += list(out.seq_ids) if out is not None else []
        assert len(given) < 100
    assert given.count(2) == 3 and given.count(1) <= 1
    s.resume([1])
    assert s.has_work


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("llama") / "model", seed=5)


def torch_engine(model_dir: Path, kv_tokens: int, prefix_caching: bool = False) -> LlamaEngine:
    return started_engine(
        model_dir, threads=1, kv_cache_tokens=kv_tokens, prefix_caching=prefix_caching
    )


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["recompute", "recompute-cached"])
def test_the_torch_engine_recomputes_a_sequence_preempted_for_kv_room(model_dir, prefix_caching):
    """A cache of 10 blocks holds the low-priority sequence (7 blocks) or the high one (4),
    not both: with --preempt the high one runs at once, the low one is recomputed after it
    and gives the tokens of its uninterrupted run."""
    low = AddRequest(1, [0] + list(range(40, 79)), 60, priority=2)
    high = AddRequest(2, [0] + list(range(100, 129)), 20, priority=0)
    roomy = torch_engine(model_dir, 1024)
    alone, _ = drive(BatchScheduler(roomy, 0, 8), {0: [low], 1: [high]})
    engine = torch_engine(model_dir, 160, prefix_caching)
    s = BatchScheduler(engine, 0, 8, preempt=True)
    tokens, _firsts = drive(s, {0: [low], 10: [high]})
    assert s.preemptions == 1
    assert tokens[1] == alone[1] and tokens[2] == alone[2]
    assert engine.cache.free_tokens == engine.cache.capacity_tokens
