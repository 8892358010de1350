"""AppRunner without processes: a user's function on a real event loop, messages captured."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from cadence.engines.app import AppContext, AppRequest
from cadence.transport.messages import RequestFailed, StepOutput, WorkerInputs, step_pieces
from cadence.vocabulary import AddRequest, Failure, Finish, Sampling
from cadence.worker.app_runner import AppRunner


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Let the loop run until `condition` holds (fails the test after `timeout`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


class Harness:
    """A runner whose output is collected; `tokens(seq)`/`finish(seq)` read it back."""

    def __init__(self, app, threads: int = 1) -> None:
        self.sent: list = []
        self.runner = AppRunner(app, worker=0, device="cpu", threads=threads, send=self.sent.append)

    def steps(self) -> list[StepOutput]:
        return [m for m in self.sent if type(m) is StepOutput]

    def failures(self) -> dict[int, RequestFailed]:
        return {m.seq_id: m for m in self.sent if type(m) is RequestFailed}

    def tokens(self, seq_id: int) -> list[int]:
        out: list[int] = []
        for step in self.steps():
            for sid, piece, _text in step_pieces(step):
                if sid == seq_id:
                    out += [piece] if type(piece) is int else piece
        return out

    def finish(self, seq_id: int) -> int | None:
        for step in self.steps():
            for sid, reason in zip(step.finished_ids, step.finish_reasons):
                if sid == seq_id:
                    return reason
        return None

    def ended(self, seq_id: int) -> bool:
        return self.finish(seq_id) is not None or seq_id in self.failures()


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def test_sync_pieces_become_tokens_and_max_tokens_cuts_the_piece_and_closes_the_function():
    closed = threading.Event()

    def app(request: AppRequest, context: AppContext):
        try:
            yield "ab"
            yield [1, 2, 3]
            yield "never sent"
        finally:
            closed.set()

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(1, [104, 105], 4))
        await _until(lambda: h.ended(1) and closed.is_set())
        assert h.tokens(1) == [97, 98, 1, 2]
        assert h.finish(1) == Finish.LENGTH
        assert any(s.token_counts for s in h.steps()), "several-token pieces carry counts"
        assert not await h.runner.close()

    run(main())


def test_generator_that_returns_finishes_with_stop_and_no_extra_tokens():
    def app(request, context):
        yield "x"

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(1, [1], 100))
        await _until(lambda: h.ended(1))
        assert h.tokens(1) == [ord("x")]
        assert h.finish(1) == Finish.STOP
        assert h.runner.active == 0
        await h.runner.close()

    run(main())


def test_stop_token_ends_the_stream_after_it():
    def app(request, context):
        assert request.stop_token_ids == [ord("c")]
        while True:
            yield "abcdef"

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(1, [1], 100, Sampling(stop_token_ids=(ord("c"),))))
        await _until(lambda: h.ended(1))
        assert h.tokens(1) == [ord("a"), ord("b"), ord("c")]
        assert h.finish(1) == Finish.STOP
        await h.runner.close()

    run(main())


def test_pieces_of_one_tick_go_out_as_one_message():
    async def app(request, context):
        yield str(request.seq_id)  # no await first: both first pieces come in one tick
        await asyncio.sleep(60)

    async def main():
        h = Harness(app)
        h.runner.apply(WorkerInputs([AddRequest(1, [1], 10), AddRequest(2, [1], 10)], []))
        await _until(lambda: len(h.tokens(1)) == 1 and len(h.tokens(2)) == 1)
        assert len(h.steps()) == 1
        assert sorted(h.steps()[0].seq_ids) == [1, 2]
        await h.runner.close()

    run(main())


def test_an_async_function_that_never_suspends_still_streams_one_piece_per_tick():
    async def app(request, context):
        for i in range(5):
            yield str(i)

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(1, [1], 10))
        await _until(lambda: h.ended(1))
        assert h.tokens(1) == [ord(c) for c in "01234"]
        assert max(len(s.seq_ids) for s in h.steps()) == 1
        await h.runner.close()

    run(main())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_exception_fails_only_its_own_stream_with_internal(kind: str):
    if kind == "sync":

        def app(request, context):
            for i in range(6):
                if request.prompt == "boom" and i == 2:
                    raise ValueError("boom at 2")
                yield "."
    else:

        async def app(request, context):
            for i in range(6):
                if request.prompt == "boom" and i == 2:
                    raise ValueError("boom at 2")
                await asyncio.sleep(0)
                yield "."

    async def main():
        h = Harness(app)
        h.runner.apply(WorkerInputs([AddRequest(1, list(b"boom"), 6), AddRequest(2, [1], 6)], []))
        await _until(lambda: h.ended(1) and h.ended(2))
        failure = h.failures()[1]
        assert failure.failure == Failure.INTERNAL
        assert "ValueError" in failure.message and "boom at 2" in failure.message
        assert h.finish(2) == Finish.LENGTH and len(h.tokens(2)) == 6
        await h.runner.close()

    run(main())


def test_a_bad_piece_fails_the_stream_with_a_message():
    def app(request, context):
        yield 3.5

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(1, [1], 5))
        await _until(lambda: h.ended(1))
        assert "yield str (text) or list[int]" in h.failures()[1].message
        await h.runner.close()

    run(main())


def test_abort_sets_cancelled_and_closes_a_sync_function_blocked_in_a_piece():
    seen: list[str] = []
    blocked = threading.Event()

    def app(request, context):
        try:
            yield "a"
            blocked.set()
            context.cancel_event.wait(30)  # blocked inside a piece until cancelled
            seen.append(f"cancelled={context.cancelled}")
            yield "b"
        finally:
            seen.append("closed")

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(1, [1], 10))
        await _until(lambda: h.tokens(1) == [ord("a")])
        # The abort must find the function inside its next piece (an abort that comes before
        # the piece starts closes the function at once, never running it: seen == ["closed"]).
        await _until(blocked.is_set)
        h.runner.apply(WorkerInputs([], [1]))
        await _until(lambda: seen == ["cancelled=True", "closed"])
        assert h.tokens(1) == [ord("a")], "nothing is sent after the abort"
        assert h.runner.active == 0
        assert not await h.runner.close()

    run(main())


def test_abort_cancels_an_async_function_at_its_await():
    seen: list[str] = []

    async def app(request, context):
        try:
            yield "a"
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append(f"cancelled={context.cancelled}")
            raise

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(1, [1], 10))
        await _until(lambda: h.tokens(1) == [ord("a")])
        h.runner.abort(1)
        await _until(lambda: seen == ["cancelled=True"])
        await h.runner.close()

    run(main())


def test_deadline_stops_the_function_and_fails_the_stream():
    def app(request, context):
        assert context.deadline is not None and context.time_remaining() > 0
        yield "a"
        context.cancel_event.wait(30)
        yield "late"

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(1, [1], 10, timeout_ms=50.0))
        await _until(lambda: h.ended(1))
        assert h.failures()[1].failure == Failure.DEADLINE_EXCEEDED
        assert h.tokens(1) == [ord("a")]
        await h.runner.close()

    run(main())


def test_request_fields_reach_the_function():
    got: list[AppRequest] = []

    def app(request, context):
        got.append(request)
        yield [context.worker]

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(7, list("hé".encode()), 3, Sampling(0.5, 0.9, 40, 11, (9,))))
        await _until(lambda: h.ended(7))
        await h.runner.close()

    run(main())
    r = got[0]
    assert (r.seq_id, r.prompt, r.max_tokens, r.stop_token_ids) == (7, "hé", 3, [9])
    assert r.sampling == Sampling(0.5, 0.9, 40, 11, (9,))
    assert (r.temperature, r.top_p, r.top_k, r.seed, r.device) == (
        0.5,
        pytest.approx(0.9),
        40,
        11,
        "cpu",
    )


def test_prompt_tokens_outside_bytes_are_refused():
    async def main():
        h = Harness(lambda request, context: iter(["x"]))
        h.runner.add(AddRequest(1, [1, 300], 3))
        await _until(lambda: 1 in h.failures())
        assert h.failures()[1].failure == Failure.INVALID_ARGUMENT
        await h.runner.close()

    run(main())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_paused_request_takes_no_piece_until_resumed(kind: str):
    taken: list[int] = []

    if kind == "sync":
        # Each piece takes a few ms, so the pause lands long before the last one.
        def app(request, context):
            for i in range(100):
                taken.append(i)
                time.sleep(0.005)
                yield "."
    else:

        async def app(request, context):
            for i in range(100):
                taken.append(i)
                await asyncio.sleep(0.005)
                yield "."

    async def main():
        h = Harness(app)
        h.runner.add(AddRequest(1, [1], 100))
        await _until(lambda: len(h.tokens(1)) >= 3)
        h.runner.apply(WorkerInputs([], [], pauses=[1]))
        seq = h.runner._seqs[1]
        # The piece in flight when the pause came still arrives; then the function waits.
        await _until(
            lambda: (
                (
                    seq.parked
                    if kind == "sync"
                    else (seq.resumed is not None and not seq.resumed.done())
                )
                and len(h.tokens(1)) == len(taken)
            )
        )
        paused_at = len(taken)
        for _ in range(20):  # the loop turns; nothing more is taken while paused
            await asyncio.sleep(0.001)
        assert len(taken) == paused_at
        h.runner.apply(WorkerInputs([], [], resumes=[1]))
        await _until(lambda: h.ended(1))
        assert len(h.tokens(1)) == 100
        await h.runner.close()

    run(main())
