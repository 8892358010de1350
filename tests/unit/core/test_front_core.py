"""FrontCore.open: the one way into the data path, with in-process fakes."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from cadence.config import ServerConfig
from cadence.core.errors import RequestError
from cadence.core.generation import FrontCore, Generation
from cadence.core.metrics import CADENCE_V1, KSERVE, OPENAI, FrontMetrics
from cadence.core.requests import Request
from cadence.router import WorkerRouter
from cadence.vocabulary import AddRequest, Failure, Finish


class FakeLink:
    """Records what the core sends a worker."""

    def __init__(self) -> None:
        self.added: list = []
        self.aborted: list[int] = []

    def add(self, request: msgspec.Raw) -> None:
        self.added.append(msgspec.msgpack.decode(request, type=AddRequest))

    def abort(self, seq_id: int) -> None:
        self.aborted.append(seq_id)


def make_core(workers: int = 2, max_concurrent: int = 4):
    links = [FakeLink() for _ in range(workers)]
    router = WorkerRouter(workers)
    core = FrontCore(ServerConfig(max_concurrent=max_concurrent), links, router, FrontMetrics())
    core.refusal = None
    return core, core.streams, links, router


def request(request_id: str = "", max_tokens: int = 5) -> Request:
    return Request(request_id=request_id, prompt="hi", max_tokens=max_tokens)


def no_deadline() -> None:
    return None


def requests_total(core: FrontCore, code: str, protocol: str = CADENCE_V1) -> float:
    return (
        core.metrics.registry.get_sample_value(
            "cadence_requests_total", {"code": code, "protocol": protocol}
        )
        or 0
    )


def test_open_registers_and_leaving_gives_everything_back() -> None:
    async def run() -> None:
        core, streams, links, router = make_core()
        generation = core.open(request("mine"), 1, no_deadline, protocol=CADENCE_V1)
        with generation:
            stream = generation.stream
            seq_id = stream.seq_id
            assert streams == {seq_id: stream} and generation.request_id == "mine"
            assert core.active == 1 and router.load[stream.worker] == 5
            assert links[stream.worker].added[0].seq_id == seq_id
            assert stream.task is asyncio.current_task()
        assert streams == {} and core.active == 0 and router.load == [0, 0]
        # Not finished by the worker: aborted there; counted as cancelled.
        assert links[stream.worker].aborted == [seq_id]
        assert requests_total(core, "CANCELLED") == 1

    asyncio.run(run())


def test_a_finished_stream_is_not_aborted_and_counts_ok() -> None:
    async def run() -> None:
        core, _, links, _ = make_core()
        generation = core.open(request(), 1, no_deadline, protocol=CADENCE_V1)
        with generation:
            stream = generation.stream
            stream.end(Finish.LENGTH)
            assert [chunk.finish async for chunk in generation] == [Finish.LENGTH]
        assert links[stream.worker].aborted == []
        assert generation.request_id  # assigned by the server
        assert requests_total(core, "OK") == 1

    asyncio.run(run())


def test_refusals_take_nothing() -> None:
    async def run() -> None:
        core, streams, _, router = make_core(workers=1, max_concurrent=1)
        with core.open(request("dup"), 1, no_deadline, protocol=CADENCE_V1):
            with pytest.raises(RequestError) as dup:
                core.open(request("dup"), 1, no_deadline, protocol=CADENCE_V1)
            assert dup.value.failure == Failure.INVALID_ARGUMENT
            # Another protocol's ids need not be unique, but the gate is full.
            with pytest.raises(RequestError) as full:
                core.open(request("dup"), 1, no_deadline, protocol=KSERVE, unique_id=False)
            assert full.value.failure == Failure.RESOURCE_EXHAUSTED
        router.mark_dead(0)
        with pytest.raises(RequestError) as dead:
            core.open(request(), 1, no_deadline, protocol=CADENCE_V1)
        assert dead.value.failure == Failure.UNAVAILABLE
        assert streams == {} and core.active == 0

    asyncio.run(run())


def test_a_non_unique_id_does_not_release_another_streams_id() -> None:
    async def run() -> None:
        core, _, _, _ = make_core()
        with core.open(request("same"), 1, no_deadline, protocol=CADENCE_V1):
            with core.open(request("same"), 1, no_deadline, protocol=KSERVE, unique_id=False):
                pass
            with pytest.raises(RequestError):  # still held by the first
                core.open(request("same"), 1, no_deadline, protocol=CADENCE_V1)

    asyncio.run(run())


def test_the_deadline_fails_the_stream_and_reaches_the_worker() -> None:
    async def run() -> None:
        core, _, links, _ = make_core()
        generation = core.open(request(), 1, lambda: 0.01, protocol=CADENCE_V1)
        with generation:
            stream = generation.stream
            assert links[stream.worker].added[0].timeout_ms == pytest.approx(10.0)
            with pytest.raises(RequestError) as failed:
                await asyncio.wait_for(anext(generation), 1)
            assert failed.value.failure == Failure.DEADLINE_EXCEEDED
        assert requests_total(core, "DEADLINE_EXCEEDED") == 1

    asyncio.run(run())


def test_a_starting_server_refuses_and_counts_it() -> None:
    async def run() -> None:
        core, streams, _, _ = make_core()
        core.refusal = "the server is starting; retry shortly"
        with pytest.raises(RequestError) as starting:
            core.open(request(), 1, no_deadline, protocol=CADENCE_V1)
        assert starting.value.failure == Failure.UNAVAILABLE
        assert streams == {} and requests_total(core, "UNAVAILABLE") == 1

    asyncio.run(run())


def test_the_generation_records_ttft_and_itl_once_per_chunk() -> None:
    async def run() -> None:
        core, _, _, _ = make_core()
        generation: Generation = core.open(request(), 1, no_deadline, protocol=CADENCE_V1)
        with generation:
            stream = generation.stream
            stream.push([104], None, 2, 3, 4)
            first = await anext(generation)
            stream.push([105, 33], None, 5, 6, 7)
            stream.end(Finish.LENGTH)
            second = await anext(generation)
            assert (first.index, second.index, second.finish) == (0, 1, Finish.LENGTH)
            with pytest.raises(StopAsyncIteration):
                await anext(generation)
        value = core.metrics.registry.get_sample_value
        by_protocol = {"protocol": CADENCE_V1}
        assert value("cadence_time_to_first_token_seconds_count", by_protocol) == 1
        assert value("cadence_inter_token_latency_seconds_count", by_protocol) == 1
        assert requests_total(core, "OK") == 1

    asyncio.run(run())


def test_the_generation_stamps_send_ns_on_each_timed_chunk() -> None:
    async def run() -> None:
        core, _, _, _ = make_core()
        timed = Request(prompt="hi", max_tokens=5, include_timing=True)
        with core.open(timed, 1, no_deadline, protocol=CADENCE_V1) as generation:
            stream = generation.stream
            stream.push([104], None, 2, 3, 4)
            first = await anext(generation)
            stream.push([105], None, 5, 6, 7)
            second = await anext(generation)
        assert first.timing.send_ns > 0
        assert second.timing.send_ns >= first.timing.send_ns

    asyncio.run(run())


def test_each_protocol_has_its_own_series() -> None:
    """What a dashboard splits by `protocol`: each request's metrics under its adapter's
    label, refusals too, nothing under another's."""

    async def run() -> None:
        core, _, _, _ = make_core()
        for protocol in (CADENCE_V1, KSERVE, KSERVE):
            generation = core.open(request(), 1, no_deadline, protocol=protocol, unique_id=False)
            with generation:
                generation.stream.end(Finish.LENGTH)
                assert [chunk.finish async for chunk in generation] == [Finish.LENGTH]
        core.refused(Failure.NOT_FOUND, OPENAI)
        value = core.metrics.registry.get_sample_value
        for protocol, finished in ((CADENCE_V1, 1), (KSERVE, 2)):
            assert requests_total(core, "OK", protocol) == finished
            labels = {"protocol": protocol}
            assert value("cadence_request_duration_seconds_count", labels) == finished
            assert value("cadence_time_to_first_token_seconds_count", labels) == finished
            assert value("cadence_queue_wait_seconds_count", labels) == finished
        assert requests_total(core, "NOT_FOUND", OPENAI) == 1
        assert requests_total(core, "OK", OPENAI) == 0
        # A refusal never started: no latency of its own.
        assert value("cadence_request_duration_seconds_count", {"protocol": OPENAI}) is None

    asyncio.run(run())


def test_request_duration_buckets_reach_long_streams() -> None:
    """A 20-minute stream lands in a bucket of its own, not in +Inf with every long one; the
    short bounds stay (queries over them keep their meaning)."""
    metrics = FrontMetrics()
    durations = metrics.for_protocol(OPENAI).e2e
    durations.observe(0.04)
    durations.observe(20 * 60)
    value = metrics.registry.get_sample_value
    bucket = "cadence_request_duration_seconds_bucket"
    assert value(bucket, {"protocol": OPENAI, "le": "0.05"}) == 1
    assert value(bucket, {"protocol": OPENAI, "le": "30.0"}) == 1
    assert value(bucket, {"protocol": OPENAI, "le": "600.0"}) == 1
    assert value(bucket, {"protocol": OPENAI, "le": "1200.0"}) == 2
    assert value(bucket, {"protocol": OPENAI, "le": "1800.0"}) == 2


def test_the_output_reader_writes_for_the_adapter_until_it_must_act() -> None:
    """Generation.write_from_reader: each step's chunk goes to the adapter's writer without
    waking its task, until the writer asks the task to act or fails (met in the task)."""

    async def run() -> None:
        core, _, _, _ = make_core()
        generation = core.open(request(max_tokens=8), 1, no_deadline, protocol=OPENAI)
        with generation:
            stream = generation.stream
            written = []

            def write(chunk) -> bool:
                written.append(chunk.token_ids)
                return len(written) == 2  # the second write asks the task to act

            def step(token: int) -> None:  # as the output reader does for one step
                stream.push(token, None, 1, 2, 3)
                stream.flush()

            handing = asyncio.ensure_future(generation.write_from_reader(write))
            await asyncio.sleep(0)
            step(5)
            assert written == [[5]] and not handing.done()
            assert stream.sending_since_ns == 0  # written: not a stalled client
            step(6)
            await asyncio.wait_for(handing, 5)
            assert written == [[5], [6]]
            step(7)  # the task's own now: waiting for its `take`
            assert written == [[5], [6]]
            await generation.write_from_reader(write)  # output waits: returns at once
            assert generation.take().token_ids == [7]

            def broken(chunk) -> bool:
                raise ConnectionResetError("the client went away")

            handing = asyncio.ensure_future(generation.write_from_reader(broken))
            await asyncio.sleep(0)
            step(8)
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(handing, 5)
            stream.fail(Failure.UNAVAILABLE, "the worker stopped")
            assert generation.error == (Failure.UNAVAILABLE, "the worker stopped")

    asyncio.run(run())
