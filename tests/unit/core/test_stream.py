"""RequestStream: the per-request buffer between the output reader and one request's
Generation."""

from __future__ import annotations

import asyncio

import pytest

from cadence.api.v1.service import to_chunk
from cadence.byte_tokenizer import ByteTokenizer
from cadence.core.metrics import FrontMetrics, StreamTally
from cadence.core.stream import MAX_CHUNK_BYTES, TOKEN_ID_BYTES, RequestStream
from cadence.proto.v1 import inference_pb2 as pb
from cadence.vocabulary import Failure, Finish

_TALLIES: dict[int, StreamTally] = {}


def make_stream(
    *,
    capacity: int = 64,
    overflow: str = "merge",
    include_timing: bool = False,
    prompt_tokens: int = 3,
    received_ns: int = 1_000,
    worker: int = 2,
) -> RequestStream:
    tally = StreamTally()
    stream = RequestStream(
        7,
        worker,
        prompt_tokens,
        capacity=capacity,
        overflow=overflow,
        include_timing=include_timing,
        decoder=ByteTokenizer().stream_decoder(),
        received_ns=received_ns,
        tally=tally,
    )
    _TALLIES[id(stream)] = tally
    return stream


def tally_of(stream: RequestStream) -> StreamTally:
    """What the stream counted into its front's totals."""
    return _TALLIES[id(stream)]


def push_step(stream: RequestStream, token: int, step: int) -> None:
    """One step's token, with distinct, increasing timestamps per step."""
    base = 10_000 + 100 * step
    stream.push([token], None, start_ns=base, end_ns=base + 50, recv_ns=base + 60)


# -- chunking -------------------------------------------------------------------------------


def test_waiting_tokens_go_out_as_one_chunk_with_contiguous_indexes():
    s = make_stream()
    for step, t in enumerate(b"abc"):
        push_step(s, t, step)
    first = s.take_chunk()
    assert list(first.token_ids) == list(b"abc")
    assert first.index == 0
    assert first.text == "abc"
    assert to_chunk(first, "req-7").request_id == "req-7"
    assert first.finish == pb.FINISH_REASON_UNSPECIFIED

    push_step(s, ord("d"), 3)
    second = s.take_chunk()
    assert list(second.token_ids) == [ord("d")]
    assert second.index == 3

    for step, t in enumerate(b"ef", start=4):
        push_step(s, t, step)
    third = s.take_chunk()
    assert third.index == 4
    assert third.text == "ef"
    assert s.sent_tokens == 6
    assert tally_of(s).chunks == 3


def test_take_chunk_empties_the_buffer():
    s = make_stream()
    push_step(s, ord("x"), 0)
    assert s.waiting_steps
    s.take_chunk()
    assert not s.waiting_steps
    assert not s.done


def test_prompt_tokens_only_on_first_chunk():
    s = make_stream(prompt_tokens=5)
    push_step(s, ord("a"), 0)
    first = s.take_chunk()
    push_step(s, ord("b"), 1)
    second = s.take_chunk()
    assert first.prompt_tokens == 5
    assert second.prompt_tokens == 0


def test_finish_reason_only_on_last_chunk():
    s = make_stream()
    push_step(s, ord("a"), 0)
    push_step(s, ord("b"), 1)
    early = s.take_chunk()
    assert early.finish == pb.FINISH_REASON_UNSPECIFIED
    assert not s.done

    push_step(s, ord("c"), 2)
    s.end(Finish.LENGTH)
    assert s.done and s.waiting_steps
    last = s.take_chunk()
    assert last.finish == pb.FINISH_REASON_LENGTH
    assert list(last.token_ids) == [ord("c")]
    assert last.index == 2


def test_finish_reason_values_match_proto_enum():
    for reason, proto in [
        (Finish.LENGTH, pb.FINISH_REASON_LENGTH),
        (Finish.STOP, pb.FINISH_REASON_STOP),
        (Finish.CANCELLED, pb.FINISH_REASON_CANCELLED),
    ]:
        s = make_stream()
        push_step(s, ord("z"), 0)
        s.end(reason)
        assert to_chunk(s.take_chunk(), "x").finish_reason == proto


def test_a_chunk_stops_merging_before_its_byte_bound_and_the_rest_follows():
    """Steps with text (a worker that detokenizes): whole steps per chunk, at most
    MAX_CHUNK_BYTES each (text bytes + TOKEN_ID_BYTES per id), the finish on the last."""
    s = make_stream()
    piece = "é" * 100_000  # 200,000 bytes of text and 2,000 ids per step
    for step in range(20):
        s.push(list(range(2_000)), piece, 10 + step, 20 + step, 30 + step)
    s.end(Finish.LENGTH)
    chunks = []
    while s.waiting_steps:
        chunks.append(s.take_chunk())
    per_step = 200_000 + TOKEN_ID_BYTES * 2_000
    assert len(chunks) == -(-20 // (MAX_CHUNK_BYTES // per_step))
    for chunk in chunks:
        assert len(chunk.text.encode()) + TOKEN_ID_BYTES * len(chunk.token_ids) <= MAX_CHUNK_BYTES
        assert chunk.text == piece * (len(chunk.token_ids) // 2_000)
    assert [c.finish for c in chunks] == [Finish.NONE] * (len(chunks) - 1) + [Finish.LENGTH]
    assert [c.index for c in chunks] == [
        sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))
    ]
    assert sum(len(c.token_ids) for c in chunks) == 40_000


def test_a_models_text_pieces_are_one_position_each_split_or_merged():
    """A stream of a model's text pieces (`counts_pieces`): each piece is one position (the
    chunk's `outputs`, the next chunk's index, the tally) whatever its ids; a chunk cut at the
    byte bound covers the pieces it took. One-id pieces need no `outputs`."""
    s = make_stream()
    s.counts_pieces = True
    s.push(list("wörd ".encode()), "wörd ", 1, 2, 3)
    s.push(list(b"ok "), "ok ", 1, 2, 3)
    chunk = s.take_chunk()
    assert (chunk.index, chunk.outputs, chunk.positions) == (0, 2, 2)
    assert to_chunk(chunk, "r").outputs == 2 and chunk.text == "wörd ok "
    s.push([7], "x", 1, 2, 3)
    chunk = s.take_chunk()
    assert (chunk.index, chunk.outputs, chunk.positions) == (2, 0, 1)
    piece = "é" * 100_000  # 200,000 bytes and byte ids: two pieces per chunk at most
    for _ in range(5):
        s.push(list(piece.encode()), piece, 1, 2, 3)
    s.end(Finish.LENGTH)
    chunks = []
    while s.waiting_steps:
        chunks.append(s.take_chunk())
    assert [c.outputs for c in chunks] == [2, 2, 1] and chunks[-1].finish == Finish.LENGTH
    assert [c.index for c in chunks] == [3, 5, 7] and "".join(c.text for c in chunks) == piece * 5
    assert s.sent_tokens == tally_of(s).tokens == 8


def test_one_step_over_the_byte_bound_goes_alone_and_byte_tokens_split_anywhere():
    s = make_stream()
    s.push([1], "x" * MAX_CHUNK_BYTES, 1, 2, 3)  # alone over the bound: sent whole
    s.push([2], "y", 1, 2, 3)
    assert s.take_chunk().token_ids == [1] and s.waiting_steps == 1
    assert s.take_chunk().text == "y" and s.waiting_steps == 0
    # Byte tokens the front decodes: split where the bound falls, a character across the cut.
    s = make_stream()
    data = "é".encode() * (MAX_CHUNK_BYTES // 2)
    s.push(list(data), None, 1, 2, 3)
    s.end(Finish.STOP)
    chunks = []
    while s.waiting_steps:
        chunks.append(s.take_chunk())
    assert len(chunks) > 1 and chunks[-1].finish == Finish.STOP
    assert "".join(c.text for c in chunks) == data.decode()
    assert all(c.finish == Finish.NONE for c in chunks[:-1])


def test_merged_steps_counts_steps_that_shared_a_chunk():
    s = make_stream()
    push_step(s, 1, 0)
    s.take_chunk()  # one step alone: nothing merged
    assert tally_of(s).merged_steps == 0
    for step in range(1, 5):
        push_step(s, 1, step)
    s.take_chunk()  # four steps in one chunk: three merged into the first
    assert tally_of(s).merged_steps == 3
    push_step(s, 1, 5)
    push_step(s, 1, 6)
    s.take_chunk()
    assert tally_of(s).merged_steps == 4
    assert tally_of(s).overflows == 0


# -- overflow -------------------------------------------------------------------------------


def test_overflow_merge_keeps_every_token_and_counts_overflows():
    s = make_stream(capacity=2, overflow="merge")
    tokens = list(b"hello")
    for step, t in enumerate(tokens):
        push_step(s, t, step)
    # Capacity 2: the 3rd, 4th and 5th pushes each found 2 or more steps waiting.
    assert tally_of(s).overflows == 3
    assert s.error is None
    chunk = s.take_chunk()
    assert list(chunk.token_ids) == tokens
    assert chunk.text == "hello"
    assert tally_of(s).merged_steps == 4

    # Once drained, the buffer takes `capacity` steps again before overflowing.
    push_step(s, ord("!"), 5)
    push_step(s, ord("!"), 6)
    assert tally_of(s).overflows == 3
    push_step(s, ord("!"), 7)
    assert tally_of(s).overflows == 4


def test_no_overflow_at_exactly_capacity():
    s = make_stream(capacity=3, overflow="abort")
    for step in range(3):
        push_step(s, 65, step)
    assert tally_of(s).overflows == 0
    assert s.error is None
    assert len(s.take_chunk().token_ids) == 3


def test_overflow_abort_fails_with_resource_exhausted():
    s = make_stream(capacity=2, overflow="abort")
    push_step(s, 65, 0)
    push_step(s, 66, 1)
    assert s.error is None
    push_step(s, 67, 2)
    assert tally_of(s).overflows == 1
    assert s.done
    assert s.error is not None
    failure, message = s.error
    assert failure is Failure.RESOURCE_EXHAUSTED
    assert "queue" in message and "2" in message
    # The overflowing token was not buffered.
    assert list(s.take_chunk().token_ids) == [65, 66]


# -- failure --------------------------------------------------------------------------------


def test_fail_first_failure_wins():
    s = make_stream()
    s.fail(Failure.DEADLINE_EXCEEDED, "deadline")
    s.fail(Failure.INVALID_ARGUMENT, "later")
    assert s.error == (Failure.DEADLINE_EXCEEDED, "deadline")
    assert s.done


def test_fail_after_finish_is_ignored():
    s = make_stream()
    push_step(s, 65, 0)
    s.end(Finish.STOP)
    s.fail(Failure.DEADLINE_EXCEEDED, "too late")
    assert s.error is None
    assert s.take_chunk().finish == pb.FINISH_REASON_STOP


def test_abort_overflow_does_not_replace_earlier_failure():
    s = make_stream(capacity=1, overflow="abort")
    s.fail(Failure.DEADLINE_EXCEEDED, "deadline")
    push_step(s, 65, 0)
    push_step(s, 66, 1)
    assert s.error[0] is Failure.DEADLINE_EXCEEDED


# -- wait -----------------------------------------------------------------------------------


def test_wait_returns_immediately_when_tokens_are_waiting():
    s = make_stream()
    push_step(s, 65, 0)

    async def main() -> None:
        # A waiter that needed a wake-up would never finish: nothing else runs.
        await asyncio.wait_for(s.wait(), timeout=5)

    asyncio.run(main())


def test_wait_returns_immediately_when_done():
    for finish in (True, False):
        s = make_stream()
        if finish:
            s.end(Finish.LENGTH)
        else:
            s.fail(Failure.CANCELLED, "gone")

        async def main(stream: RequestStream = s) -> None:
            await asyncio.wait_for(stream.wait(), timeout=5)

        asyncio.run(main())


def test_wait_blocks_until_push():
    s = make_stream()
    events: list[str] = []

    async def consumer() -> None:
        events.append("waiting")
        await s.wait()
        events.append("woke")

    async def main() -> None:
        task = asyncio.create_task(consumer())
        # Let the consumer reach its wait; it must not get past it without a push.
        for _ in range(5):
            await asyncio.sleep(0)
        assert events == ["waiting"]
        assert not task.done()
        push_step(s, 65, 0)
        events.append("pushed")
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(main())
    assert events == ["waiting", "pushed", "woke"]
    assert s.waiting_steps


@pytest.mark.parametrize("how", ["end", "fail"])
def test_wait_wakes_on_end_or_fail(how: str):
    s = make_stream()

    async def main() -> None:
        task = asyncio.ensure_future(s.wait())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()
        if how == "end":
            s.end(Finish.CANCELLED)
        else:
            s.fail(Failure.DEADLINE_EXCEEDED, "deadline")
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(main())
    assert s.done


# -- timing ---------------------------------------------------------------------------------


def test_include_timing_fills_timing_fields():
    s = make_stream(include_timing=True, received_ns=500, worker=3)
    s.push([ord("a")], None, start_ns=1_000, end_ns=1_100, recv_ns=1_150)
    s.push([ord("b")], None, start_ns=2_000, end_ns=2_100, recv_ns=2_150)
    first = s.take_chunk()
    assert first.timing is not None
    t = first.timing
    assert t.worker == 3
    assert t.received_ns == 500
    assert t.scheduled_ns == 1_000  # the first step of the request
    # Per-token fields describe the chunk's first (oldest) token.
    assert (t.step_start_ns, t.step_end_ns, t.front_recv_ns) == (1_000, 1_100, 1_150)
    # send_ns: stamped when the Generation hands the chunk out (test_front_core.py).

    s.push([ord("c")], None, start_ns=3_000, end_ns=3_100, recv_ns=3_150)
    s.push([ord("d")], None, start_ns=4_000, end_ns=4_100, recv_ns=4_150)
    second = s.take_chunk()
    t2 = second.timing
    assert second.index == 2
    assert t2.worker == 3
    assert t2.received_ns == 0 and t2.scheduled_ns == 0  # first chunk only
    assert (t2.step_start_ns, t2.step_end_ns, t2.front_recv_ns) == (3_000, 3_100, 3_150)


def test_no_timing_unless_asked():
    s = make_stream(include_timing=False)
    push_step(s, 65, 0)
    chunk = s.take_chunk()
    assert chunk.timing is None
    assert not to_chunk(chunk, "x").HasField("timing")


# -- UTF-8 ----------------------------------------------------------------------------------


def test_multibyte_character_split_across_chunks_is_decoded_once_complete():
    s = make_stream()
    data = "añ€😀".encode()  # 1 + 2 + 3 + 4 bytes
    assert len(data) == 10
    texts = []
    # Push the bytes one step at a time, taking a chunk after every step.
    for step, byte in enumerate(data):
        push_step(s, byte, step)
        if step == len(data) - 1:
            s.end(Finish.LENGTH)
        texts.append(s.take_chunk().text)
    assert "".join(texts) == "añ€😀"
    assert "\ufffd" not in "".join(texts)
    # Each character appears in the chunk that completes it, nothing before.
    assert texts == ["a", "", "ñ", "", "", "€", "", "", "", "😀"]


def test_incomplete_character_at_finish_becomes_replacement():
    s = make_stream()
    euro = "€".encode()
    push_step(s, euro[0], 0)
    push_step(s, euro[1], 1)
    assert s.take_chunk().text == ""
    s.end(Finish.LENGTH)
    assert s.take_chunk().text == "\ufffd"


# -- block policy: pauses and the metrics that count them -----------------------------------


class PauseLink:
    """Records the pauses and resumes a stream asks of its worker."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.paused = 0

    def pause(self, seq_id: int) -> None:
        self.paused += 1
        self.calls.append(("pause", seq_id))

    def resume(self, seq_id: int) -> None:
        self.calls.append(("resume", seq_id))


_FRONT_METRICS = FrontMetrics()
"""The metrics of the front the blocking streams below belong to."""


def blocking_stream(capacity: int = 2, overflow: str = "block") -> tuple[RequestStream, PauseLink]:
    link = PauseLink()
    stream = RequestStream(
        7,
        0,
        3,
        capacity=capacity,
        overflow=overflow,
        include_timing=False,
        decoder=ByteTokenizer().stream_decoder(),
        received_ns=1_000,
        link=link,
        tally=_FRONT_METRICS.tally,
    )
    _TALLIES[id(stream)] = _FRONT_METRICS.tally
    return stream, link


def pause_samples() -> tuple[float, float]:
    """(cadence_sequence_pauses_total, cadence_paused_sequences) as the front exports them."""
    registry = _FRONT_METRICS.registry
    return (
        registry.get_sample_value("cadence_sequence_pauses_total"),
        registry.get_sample_value("cadence_paused_sequences"),
    )


def test_block_counts_each_pause_once_and_the_gauge_follows_resumes():
    issued, paused = pause_samples()
    s, link = blocking_stream()
    for step in range(5):  # capacity 2: the third step pauses; later pushes do not re-pause
        push_step(s, 65, step)
    assert link.calls == [("pause", 7)] and link.paused == 1
    assert pause_samples() == (issued + 1, paused + 1)
    s.take_chunk()  # the client read: resumed, off the gauge, still counted as issued
    assert link.calls == [("pause", 7), ("resume", 7)] and link.paused == 0
    assert pause_samples() == (issued + 1, paused)
    for step in range(5, 8):  # a second pause is a second one issued
        push_step(s, 65, step)
    assert pause_samples() == (issued + 2, paused + 1)
    s.take_chunk()
    assert pause_samples() == (issued + 2, paused)


def test_merge_never_pauses():
    issued, paused = pause_samples()
    s, link = blocking_stream(overflow="merge")
    overflows = tally_of(s).overflows  # the front's total so far
    for step in range(10):
        push_step(s, 65, step)
    assert tally_of(s).overflows - overflows == 8 and link.calls == []
    assert pause_samples() == (issued, paused)


def test_a_paused_stream_that_fails_leaves_the_gauge():
    issued, paused = pause_samples()
    s, _ = blocking_stream()
    for step in range(3):
        push_step(s, 65, step)
    assert pause_samples() == (issued + 1, paused + 1)
    s.fail(Failure.DEADLINE_EXCEEDED, "deadline")
    assert pause_samples() == (issued + 1, paused)
    s.fail(Failure.CANCELLED, "again")  # ignored: counted off once
    assert pause_samples() == (issued + 1, paused)


def test_a_paused_stream_whose_client_goes_away_leaves_the_gauge():
    issued, paused = pause_samples()

    async def main() -> None:
        s, _ = blocking_stream()

        async def handler() -> None:  # the RPC's task: cancelled when its client goes
            await asyncio.sleep(3600)

        s.task = asyncio.create_task(handler())
        for step in range(3):
            push_step(s, 65, step)
        assert pause_samples() == (issued + 1, paused + 1)
        s.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await s.task
        await asyncio.sleep(0)  # done callbacks run on the next turn of the loop
        assert pause_samples() == (issued + 1, paused)

    asyncio.run(main())


def test_a_resumed_stream_stops_watching_its_task():
    async def main() -> None:
        issued, paused = pause_samples()
        s, _ = blocking_stream()
        s.task = asyncio.create_task(asyncio.sleep(3600))
        for step in range(3):
            push_step(s, 65, step)
        s.take_chunk()
        s.task.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # Counted off by the resume, not a second time by the task's end.
        assert pause_samples() == (issued + 1, paused)

    asyncio.run(main())
