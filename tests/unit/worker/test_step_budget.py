"""Chunked prefill under a step budget: the scheduler's cutting and the budgets' rules
(cadence.worker.batch_scheduler, cadence.worker.step_budget) over the synthetic engine."""

from __future__ import annotations

import random

import pytest

from cadence.config import EngineConfig, ServerConfig
from cadence.engines.base import Sequence
from cadence.engines.synthetic import SyntheticEngine
from cadence.transport.messages import StepOutput
from cadence.vocabulary import AddRequest, Finish
from cadence.worker.batch_scheduler import BatchScheduler
from cadence.worker.step_budget import (
    MIN_PREFILL_CHUNK,
    STARTUP_PREFILL,
    FixedBudget,
    StepTimeModel,
    TargetBudget,
    budget_for,
)

LONG = [ord("a") + i % 26 for i in range(1000)]


class Recording(SyntheticEngine):
    """Zero-time synthetic engine that records each step's chunks and releases."""

    def __init__(self, chunks: bool = True) -> None:
        super().__init__(EngineConfig(step_ms=0, prefill_ms_per_token=0))
        self.takes_prefill_chunks = chunks
        self.steps: list[tuple[list[tuple[int, int, int]], list[int]]] = []
        self.released: list[int] = []

    def step(self, prefill, decode):
        self.steps.append(
            ([(s.seq_id, s.prefilled, s.prefill_to) for s in prefill], [s.seq_id for s in decode])
        )
        return super().step(prefill, decode)

    def release(self, seq):
        self.released.append(seq.seq_id)


def req(seq_id: int, prompt: list[int], max_tokens: int = 4) -> AddRequest:
    return AddRequest(seq_id, prompt, max_tokens)


def run_to_end(s: BatchScheduler) -> list[StepOutput]:
    outs = []
    while (out := s.step()) is not None:
        outs.append(out)
    return outs


def tokens_of(outs: list[StepOutput], seq_id: int) -> list[int]:
    return [t for o in outs for s, t in zip(o.seq_ids, o.token_ids) if s == seq_id]


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_decodes():
    engine = Recording()
    s = BatchScheduler(engine, 0, 64, FixedBudget(64))
    for i in range(3):
        s.add(req(i, list(b"short"), max_tokens=40))
    s.step()  # the three short prompts (15 tokens) in one step
    s.add(req(9, LONG, max_tokens=3))
    outs = run_to_end(s)
    chunks = [c for prefill, _ in engine.steps[1:] for c in prefill]
    # 64 - 3 decodes = 61 prompt tokens a step, in order, to the end of the prompt.
    assert chunks[0] == (9, 0, 61) and chunks[1] == (9, 61, 122)
    assert chunks[-1][2] == 1000 and len(chunks) == -(-1000 // 61)
    assert all(a[2] == b[1] for a, b in zip(chunks, chunks[1:]))
    # Every one of those steps decoded the three others; the long one had no output until
    # its last chunk, and its first token came with it.
    assert all(decode == [0, 1, 2] for _, decode in engine.steps[1 : len(chunks) + 1])
    first = next(i for i, o in enumerate(outs) if 9 in o.seq_ids)
    assert first == len(chunks) - 1
    assert all(o.seq_ids == [0, 1, 2] for o in outs[:first])
    # Its tokens are those of an unchunked run.
    whole = BatchScheduler(Recording(), 0, 64)
    whole.add(req(9, LONG, max_tokens=3))
    assert tokens_of(outs, 9) == tokens_of(run_to_end(whole), 9)


def test_the_oldest_prompt_is_prefilled_first_and_the_budget_is_shared():
    engine = Recording()
    s = BatchScheduler(engine, 0, 64, FixedBudget(100))
    s.add(req(1, LONG[:150], max_tokens=1))
    s.add(req(2, LONG[:120], max_tokens=1))
    outs = run_to_end(s)
    assert [p for p, _ in engine.steps] == [
        [(1, 0, 100)],
        [(1, 100, 150), (2, 0, 50)],
        [(2, 50, 120)],
    ]
    assert [o.seq_ids for o in outs] == [[], [1], [2]]
    assert [o.finish_reasons for o in outs] == [[], [Finish.LENGTH], [Finish.LENGTH]]


def test_prefill_never_starves_when_decodes_fill_the_budget():
    engine = Recording()
    s = BatchScheduler(engine, 0, 64, FixedBudget(8))
    for i in range(10):
        s.add(req(i, [65], max_tokens=100))
    s.step()
    s.step()  # eight of the one-token prompts in the first step, two in the second
    s.add(req(99, LONG[:40], max_tokens=1))
    s.step()
    # Ten decodes are over the budget of 8: all decode anyway, and the prompt gets
    # min(16, 8) tokens.
    assert engine.steps[-1] == ([(99, 0, 8)], list(range(10)))


def test_a_cancelled_sequence_mid_prefill_is_gone_by_the_next_step():
    engine = Recording()
    s = BatchScheduler(engine, 0, 64, FixedBudget(50))
    s.add(req(1, LONG, max_tokens=5))
    s.add(req(2, LONG[:10], max_tokens=5))
    s.step()
    assert 1 in s.seq_ids() and s.has_work
    s.abort([1])
    assert engine.released == [1] and 1 not in s.seq_ids()
    s.step()
    assert engine.steps[-1][0] == [(2, 0, 10)]
    run_to_end(s)
    assert not s.has_work


def test_an_engine_without_chunks_gets_whole_prompts_that_fit_the_budget():
    engine = Recording(chunks=False)
    s = BatchScheduler(engine, 0, 64, FixedBudget(100))
    s.add(req(1, LONG[:300], max_tokens=1))  # longer than the budget: alone, whole
    s.add(req(2, LONG[:60], max_tokens=1))
    s.add(req(3, LONG[:30], max_tokens=1))
    s.add(req(4, LONG[:20], max_tokens=1))
    run_to_end(s)
    assert [p for p, _ in engine.steps] == [[(1, 0, 300)], [(2, 0, 60), (3, 0, 30)], [(4, 0, 20)]]


def test_without_a_budget_every_admitted_prompt_is_whole_in_one_step():
    engine = Recording()
    s = BatchScheduler(engine, 0, 64)
    s.add(req(1, LONG, max_tokens=2))
    s.add(req(2, LONG[:10], max_tokens=2))
    outs = run_to_end(s)
    assert engine.steps[0][0] == [(1, 0, 1000), (2, 0, 10)]
    assert outs[0].seq_ids == [1, 2]


def test_max_batch_counts_the_sequences_mid_prefill():
    engine = Recording()
    s = BatchScheduler(engine, 0, 1, FixedBudget(50))
    s.add(req(1, LONG[:120], max_tokens=1))
    s.add(req(2, LONG[:10], max_tokens=1))
    s.step()
    s.step()
    assert [p for p, _ in engine.steps] == [[(1, 0, 50)], [(1, 50, 100)]]


def test_budget_flags_are_exclusive_and_need_a_step_engine():
    assert budget_for(EngineConfig()) is None
    assert isinstance(budget_for(EngineConfig(max_step_tokens=64)), FixedBudget)
    assert isinstance(budget_for(EngineConfig(itl_target_ms=40)), TargetBudget)
    with pytest.raises(ValueError, match="give one"):
        ServerConfig(engine=EngineConfig(max_step_tokens=64, itl_target_ms=40))
    with pytest.raises(ValueError, match="step engine"):
        ServerConfig(engine=EngineConfig(name="app", app="m:f", max_step_tokens=64))


# -- the step-time model and the target budget ------------------------------------------------


def synthetic_cost(decodes: int, prefill: int) -> float:
    return 0.010 + 0.0002 * decodes + 0.002 * prefill


def test_the_step_model_converges_on_a_synthetic_step_cost():
    rng = random.Random(1)
    model = StepTimeModel()
    for _ in range(400):
        d, p = rng.randint(1, 64), rng.choice([0, 0, 0, 16, 64, 200])
        model.observe(d, p, synthetic_cost(d, p) * (1 + rng.gauss(0, 0.02)))
    fixed, per_decode, per_prefill = model.coef
    assert fixed == pytest.approx(0.010, rel=0.15)
    assert per_decode == pytest.approx(0.0002, rel=0.15)
    assert per_prefill == pytest.approx(0.002, rel=0.05)


def test_the_step_model_keeps_its_coefficients_non_negative():
    model = StepTimeModel()
    for i in range(50):  # steps that get cheaper with more decodes: noise, not a cost
        model.observe(i % 8, 32 * (i % 3), 0.02 - 0.0001 * (i % 8) + 0.001 * (i % 3))
    assert min(model.coef) >= 0.0


def test_the_target_budget_starts_slowly_then_follows_the_fit():
    budget = TargetBudget(50.0)
    assert budget.prefill_tokens(4) == STARTUP_PREFILL
    sizes = []
    for _ in range(40):
        p = budget.prefill_tokens(4)
        sizes.append(p)
        budget.observe(4, p, synthetic_cost(4, p))
        budget.observe(4, 0, synthetic_cost(4, 0))
    # Doubling while within target, then the fit: (50 - 10 - 0.8) / 2 = 19.6 tokens.
    assert sizes[:2] == [64, 32]  # 64 tokens took 138.8 ms > 50: halved
    assert budget.fitted
    assert budget.prefill_tokens(4) == 19
    assert synthetic_cost(4, budget.prefill_tokens(4)) <= 0.050
    # More decodes leave less room, never below the minimum chunk.
    assert budget.prefill_tokens(100) == 10 or budget.prefill_tokens(100) == MIN_PREFILL_CHUNK
    assert budget.prefill_tokens(1000) == MIN_PREFILL_CHUNK


def test_the_target_budget_grows_no_faster_than_twice_what_it_measured():
    budget = TargetBudget(1000.0)
    seen = []
    for _ in range(6):
        p = budget.prefill_tokens(0)
        seen.append(p)
        budget.observe(0, p, 0.001 + 0.00001 * p)
    assert seen == [64, 128, 256, 512, 1024, 2048]


def test_the_scheduler_under_a_target_keeps_steps_near_it(monkeypatch):
    """Measured step times are replaced by the synthetic cost of each step's composition."""
    engine = Recording()
    budget = TargetBudget(60.0)
    s = BatchScheduler(engine, 0, 64, budget)
    observed = []
    real = budget.observe

    def observe(decodes, prefill, seconds):
        cost = synthetic_cost(decodes, prefill)
        observed.append((decodes, prefill, cost))
        real(decodes, prefill, cost)

    budget.observe = observe
    for i in range(4):
        s.add(req(i, [66], max_tokens=10_000))
    s.step()
    for k in range(5):
        s.add(req(100 + k, LONG, max_tokens=1))
        for _ in range(150):
            s.step()
    late = [c for d, p, c in observed[-300:] if p]
    assert late and max(late) <= 0.060 * 1.02
    assert sorted(late[-50:])[25] >= 0.060 * 0.95  # and prefill uses the room
    assert budget.model.coef[2] == pytest.approx(0.002, rel=0.05)


def test_a_model_class_opts_in_to_chunks(tmp_path):
    from cadence.engines.user_model import ModelEngine

    module = tmp_path / "chunky.py"
    module.write_text(
        "class Whole:\n"
        "    def __init__(self, device): pass\n"
        "    def step(self, prefill, decode): return [65] * (len(prefill) + len(decode))\n"
        "class Chunky(Whole):\n"
        "    takes_prefill_chunks = True\n"
        "    def __init__(self, device): self.seen = []\n"
        "    def step(self, prefill, decode):\n"
        "        self.seen += [(s.prefilled, s.prefill_to) for s in prefill]\n"
        "        return [None if s.prefill_to < len(s.prompt_token_ids) else 65 for s in prefill]"
        " + [66] * len(decode)\n"
    )
    whole = ModelEngine(EngineConfig(name="model", model_class=f"{module}:Whole"), "cpu")
    assert not whole.takes_prefill_chunks
    engine = ModelEngine(EngineConfig(name="model", model_class=f"{module}:Chunky"), "cpu")
    assert engine.takes_prefill_chunks
    s = BatchScheduler(engine, 0, 8, FixedBudget(40))
    s.add(req(1, LONG[:100], max_tokens=2))
    outs = run_to_end(s)
    assert engine.model.seen == [(0, 40), (40, 80), (80, 100)]
    assert tokens_of(outs, 1) == [65, 66]


def test_sequence_defaults_describe_the_whole_prompt():
    seq = Sequence(AddRequest(1, LONG[:7], 3))
    assert (seq.prefilled, seq.prefill_to) == (0, 7)
