"""BatchScheduler over a SyntheticEngine with zero modelled time (no sleeps)."""

from __future__ import annotations

import pytest

from cadence.config import EngineConfig
from cadence.engines.base import Sequence
from cadence.engines.synthetic import SyntheticEngine
from cadence.transport.messages import RequestFailed, StepOutput
from cadence.vocabulary import AddRequest, Failure, Finish, Sampling
from cadence.worker.batch_scheduler import BatchScheduler

PROMPT = list(b"Hello, cadence")


def engine(seed: int = 0) -> SyntheticEngine:
    return SyntheticEngine(EngineConfig(step_ms=0, prefill_ms_per_token=0, seed=seed))


def scheduler(max_batch: int = 8, worker: int = 1, seed: int = 0) -> BatchScheduler:
    return BatchScheduler(engine(seed), worker, max_batch)


def req(
    seq_id: int, max_tokens: int = 4, prompt: list[int] | None = None, **sampling
) -> AddRequest:
    """A request; `sampling`: its Sampling's fields."""
    return AddRequest(
        seq_id, PROMPT if prompt is None else prompt, max_tokens, Sampling(**sampling)
    )


def run_to_end(s: BatchScheduler, limit: int = 10_000) -> list[StepOutput]:
    outs = []
    for _ in range(limit):
        out = s.step()
        if out is None:
            return outs
        outs.append(out)
    raise AssertionError("scheduler did not run out of work")


def tokens_of(outs: list[StepOutput], seq_id: int) -> list[int]:
    return [t for o in outs for s, t in zip(o.seq_ids, o.token_ids) if s == seq_id]


def generate(s: BatchScheduler, request: AddRequest) -> list[int]:
    assert s.add(request) is None
    return tokens_of(run_to_end(s), request.seq_id)


# -- stepping -------------------------------------------------------------------------------


def test_idle_scheduler_steps_nothing():
    s = scheduler()
    assert not s.has_work
    assert s.step() is None


def test_each_step_emits_one_token_per_running_sequence():
    s = scheduler(worker=5)
    for i in (1, 2, 3):
        assert s.add(req(i, max_tokens=10)) is None
    assert len(s._waiting) == 3 and len(s._running) == 0
    out = s.step()
    assert isinstance(out, StepOutput)
    assert out.worker == 5
    assert out.step == 1
    assert sorted(out.seq_ids) == [1, 2, 3]
    assert len(out.token_ids) == 3
    assert out.finished_ids == [] and out.finish_reasons == []
    assert out.start_ns <= out.end_ns
    assert len(s._running) == 3 and len(s._waiting) == 0

    out2 = s.step()
    assert out2.step == 2
    assert sorted(out2.seq_ids) == [1, 2, 3]
    assert len(out2.token_ids) == 3


def test_new_request_joins_at_next_step_boundary():
    s = scheduler()
    s.add(req(1, max_tokens=10))
    s.step()
    s.step()
    s.add(req(2, max_tokens=10))
    # Queued, not running, until the next step begins.
    assert len(s._waiting) == 1 and len(s._running) == 1
    out = s.step()
    assert sorted(out.seq_ids) == [1, 2]
    assert len(s._waiting) == 0 and len(s._running) == 2
    # The late joiner's tokens start at its own first token, not at sequence 1's position.
    assert tokens_of([out], 2) == generate(scheduler(), req(9, max_tokens=1))


def test_finish_by_length_at_max_tokens():
    s = scheduler()
    s.add(req(1, max_tokens=3))
    outs = run_to_end(s)
    assert len(outs) == 3
    assert [o.finished_ids for o in outs] == [[], [], [1]]
    assert outs[-1].finish_reasons == [Finish.LENGTH]
    assert len(tokens_of(outs, 1)) == 3
    assert not s.has_work


def test_max_tokens_one_finishes_on_first_step():
    s = scheduler()
    s.add(req(1, max_tokens=1))
    out = s.step()
    assert out.seq_ids == [1]
    assert out.finished_ids == [1]
    assert out.finish_reasons == [Finish.LENGTH]
    assert s.step() is None


def test_finish_by_stop_token():
    reference = generate(scheduler(), req(1, max_tokens=20))
    # Stop on a token (past the third) that does not occur earlier in the output.
    k = next(i for i in range(3, 20) if reference[i] not in reference[:i])
    stop = reference[k]
    s = scheduler()
    s.add(req(1, max_tokens=20, stop_token_ids=(stop,)))
    outs = run_to_end(s)
    got = tokens_of(outs, 1)
    assert got == reference[: k + 1]  # the stop token itself is sent
    assert outs[-1].finished_ids == [1]
    assert outs[-1].finish_reasons == [Finish.STOP]


def test_stop_wins_over_length_on_the_same_step():
    reference = generate(scheduler(), req(1, max_tokens=20))
    n = next(i for i in range(2, 20) if reference[i - 1] not in reference[: i - 1])
    s = scheduler()
    s.add(req(1, max_tokens=n, stop_token_ids=(reference[n - 1],)))
    outs = run_to_end(s)
    assert len(outs) == n
    assert outs[-1].finish_reasons == [Finish.STOP]


def test_finished_sequences_leave_the_batch_others_continue():
    s = scheduler()
    s.add(req(1, max_tokens=2))
    s.add(req(2, max_tokens=4))
    outs = run_to_end(s)
    assert [sorted(o.seq_ids) for o in outs] == [[1, 2], [1, 2], [2], [2]]
    assert [o.finished_ids for o in outs] == [[], [1], [], [2]]


# -- max_batch ------------------------------------------------------------------------------


def test_max_batch_limits_running_and_admits_as_slots_free():
    s = scheduler(max_batch=2)
    s.add(req(1, max_tokens=1))
    s.add(req(2, max_tokens=3))
    s.add(req(3, max_tokens=2))
    s.add(req(4, max_tokens=1))

    out = s.step()
    assert out.seq_ids == [1, 2]  # arrival order
    assert len(s._running) == 1 and len(s._waiting) == 2  # 1 finished, 3 and 4 wait

    out = s.step()
    assert sorted(out.seq_ids) == [2, 3]  # 3 took the slot 1 freed; 4 still waits
    assert len(s._waiting) == 1

    out = s.step()
    assert sorted(out.seq_ids) == [2, 3]
    assert sorted(out.finished_ids) == [2, 3]
    assert len(s._running) == 0 and len(s._waiting) == 1

    out = s.step()
    assert out.seq_ids == [4] and out.finished_ids == [4]
    assert s.step() is None


def test_batch_never_exceeds_max_batch():
    s = scheduler(max_batch=3)
    for i in range(10):
        s.add(req(i, max_tokens=1 + i % 4))
    outs = run_to_end(s)
    assert all(len(o.seq_ids) <= 3 for o in outs)
    # Every request got exactly max_tokens tokens and finished once.
    finished = [f for o in outs for f in o.finished_ids]
    assert sorted(finished) == list(range(10))
    for i in range(10):
        assert len(tokens_of(outs, i)) == 1 + i % 4


# -- abort ----------------------------------------------------------------------------------


def test_abort_removes_running_sequence_before_next_step():
    s = scheduler()
    s.add(req(1, max_tokens=10))
    s.add(req(2, max_tokens=10))
    s.step()
    s.abort([1])
    assert len(s._running) == 1
    out = s.step()
    assert out.seq_ids == [2]


def test_abort_removes_waiting_sequence():
    s = scheduler(max_batch=1)
    s.add(req(1, max_tokens=3))
    s.add(req(2, max_tokens=3))
    s.add(req(3, max_tokens=3))
    s.step()
    assert len(s._waiting) == 2
    s.abort([2])
    assert len(s._waiting) == 1
    outs = run_to_end(s)
    assert 2 not in {i for o in outs for i in o.seq_ids}
    assert tokens_of(outs, 3)


def test_abort_before_first_step_and_unknown_ids():
    s = scheduler()
    s.add(req(1))
    s.abort([1, 99])  # 99 was never added: ignored
    assert not s.has_work
    assert s.step() is None
    s.abort([])
    assert s.step() is None


def test_abort_releases_engine_state_of_running_sequence_only():
    class Recording(SyntheticEngine):
        def __init__(self) -> None:
            super().__init__(EngineConfig(step_ms=0, prefill_ms_per_token=0))
            self.released: list[int] = []

        def release(self, seq: Sequence) -> None:
            self.released.append(seq.seq_id)

    e = Recording()
    s = BatchScheduler(e, 0, max_batch=1)
    s.add(req(1, max_tokens=10))
    s.add(req(2, max_tokens=10))
    s.step()
    s.abort([1, 2])
    assert e.released == [1]
    assert not s.has_work


def test_finished_sequences_are_released():
    released: list[int] = []
    e = engine()
    e.release = lambda seq: released.append(seq.seq_id)  # type: ignore[method-assign]
    s = BatchScheduler(e, 0, max_batch=4)
    s.add(req(1, max_tokens=1))
    s.add(req(2, max_tokens=2))
    run_to_end(s)
    assert released == [1, 2]


# -- check ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [256, -1, 1000])
def test_out_of_range_prompt_ids_are_rejected(bad: int):
    s = scheduler()
    failure = s.add(req(42, prompt=[72, bad, 73]))
    assert isinstance(failure, RequestFailed)
    assert failure.seq_id == 42
    assert failure.failure == Failure.INVALID_ARGUMENT
    assert str(bad) in failure.message and "256" in failure.message
    assert not s.has_work


def test_in_range_prompt_ids_are_accepted():
    e = engine()
    assert e.check(req(1, prompt=[0, 255])) is None
    assert e.check(req(1, prompt=[])) is None


# -- determinism ----------------------------------------------------------------------------


def test_same_prompt_and_seed_give_same_tokens():
    a = generate(scheduler(), req(1, max_tokens=32, seed=7))
    b = generate(scheduler(), req(2, max_tokens=32, seed=7))
    assert a == b
    assert len(a) == 32
    assert all(0 <= t < 256 for t in a)


def test_same_request_in_one_batch_gets_same_tokens():
    s = scheduler()
    s.add(req(1, max_tokens=16, seed=3))
    s.add(req(2, max_tokens=16, seed=3))
    outs = run_to_end(s)
    assert tokens_of(outs, 1) == tokens_of(outs, 2)


def test_different_engine_seed_gives_different_tokens():
    a = generate(scheduler(seed=0), req(1, max_tokens=32))
    b = generate(scheduler(seed=1), req(1, max_tokens=32))
    assert a != b


def test_different_request_seed_or_prompt_gives_different_tokens():
    base = generate(scheduler(), req(1, max_tokens=32, seed=0))
    assert generate(scheduler(), req(1, max_tokens=32, seed=1)) != base
    assert generate(scheduler(), req(1, max_tokens=32, prompt=list(b"other"))) != base


def test_tokens_are_readable_text():
    tokens = generate(scheduler(), req(1, max_tokens=64))
    text = bytes(tokens).decode("ascii")
    assert " " in text


def test_paused_sequences_are_skipped_and_resume_where_they_stopped():
    s = scheduler()
    s.add(req(1, max_tokens=6))
    s.add(req(2, max_tokens=6))
    s.step()
    s.pause([1])
    out = s.step()
    assert out.seq_ids == [2]  # the rest of the batch goes on
    s.step()
    s.resume([1])
    outs = run_to_end(s)
    assert sum(o.seq_ids.count(1) for o in outs) == 5  # nothing skipped, nothing repeated
    assert not s.has_work


def test_a_batch_of_only_paused_sequences_has_no_work():
    s = scheduler()
    s.add(req(1, max_tokens=6))
    s.step()
    s.pause([1])
    assert not s.has_work and s.step() is None
    s.abort([1])
    s.resume([1])
    assert not s.has_work
