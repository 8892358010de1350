"""InferenceService.open_stream: the one way into the data path, with in-process fakes."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cadence.api.metrics import FrontMetrics
from cadence.api.service import InferenceService, Refused
from cadence.api.v1 import inference_pb2 as pb
from cadence.config import ServerConfig
from cadence.router import WorkerRouter
from cadence.transport.messages import Finish


class FakeLink:
    """Records what the service sends a worker."""

    def __init__(self) -> None:
        self.added: list = []
        self.aborted: list[int] = []

    def add(self, request) -> None:
        self.added.append(request)

    def abort(self, seq_id: int) -> None:
        self.aborted.append(seq_id)


def make_service(workers: int = 2, max_concurrent: int = 4):
    links = [FakeLink() for _ in range(workers)]
    router = WorkerRouter(workers)
    streams: dict = {}
    service = InferenceService(ServerConfig(max_concurrent=max_concurrent), streams, links,
                               router, FrontMetrics())
    service.refusal = None
    return service, streams, links, router


def add_request(service: InferenceService, max_tokens: int = 5):
    request = pb.GenerateRequest(prompt="hi", max_tokens=max_tokens)
    return service.to_add_request(service.next_seq_id(), request)


def no_deadline() -> None:
    return None


def requests_total(service: InferenceService, code: str) -> float:
    return service.metrics.registry.get_sample_value("cadence_requests_total", {"code": code}) or 0


def test_open_registers_and_leaving_gives_everything_back() -> None:
    async def run() -> None:
        service, streams, links, router = make_service()
        add = add_request(service)
        opened = service.open_stream(add, "mine", 1, no_deadline)
        with opened as stream:
            assert streams == {add.seq_id: stream} and stream.request_id == "mine"
            assert service.active == 1 and router.load[stream.worker] == 5
            assert links[stream.worker].added[0].seq_id == add.seq_id
            assert stream.task is asyncio.current_task()
        assert streams == {} and service.active == 0 and router.load == [0, 0]
        # Not finished by the worker: aborted there; counted as cancelled.
        assert links[stream.worker].aborted == [add.seq_id]
        assert requests_total(service, "CANCELLED") == 1

    asyncio.run(run())


def test_a_finished_stream_is_not_aborted_and_counts_ok() -> None:
    async def run() -> None:
        service, _, links, _ = make_service()
        opened = service.open_stream(add_request(service), "", 1, no_deadline)
        with opened as stream:
            stream.end(Finish.LENGTH)
            opened.code = grpc.StatusCode.OK
        assert links[stream.worker].aborted == []
        assert stream.request_id  # assigned by the server
        assert requests_total(service, "OK") == 1

    asyncio.run(run())


def test_refusals_take_nothing() -> None:
    async def run() -> None:
        service, streams, _, router = make_service(workers=1, max_concurrent=1)
        with service.open_stream(add_request(service), "dup", 1, no_deadline):
            with pytest.raises(Refused) as dup:
                service.open_stream(add_request(service), "dup", 1, no_deadline)
            assert dup.value.code == grpc.StatusCode.INVALID_ARGUMENT
            # Another protocol's ids need not be unique, but the gate is full.
            with pytest.raises(Refused) as full:
                service.open_stream(add_request(service), "dup", 1, no_deadline, unique_id=False)
            assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        router.mark_dead(0)
        with pytest.raises(Refused) as dead:
            service.open_stream(add_request(service), "", 1, no_deadline)
        assert dead.value.code == grpc.StatusCode.UNAVAILABLE
        assert streams == {} and service.active == 0

    asyncio.run(run())


def test_a_non_unique_id_does_not_release_another_streams_id() -> None:
    async def run() -> None:
        service, _, _, _ = make_service()
        with service.open_stream(add_request(service), "same", 1, no_deadline):
            with service.open_stream(add_request(service), "same", 1, no_deadline,
                                     unique_id=False):
                pass
            with pytest.raises(Refused):  # still held by the first
                service.open_stream(add_request(service), "same", 1, no_deadline)

    asyncio.run(run())


def test_the_deadline_fails_the_stream_and_reaches_the_worker() -> None:
    async def run() -> None:
        service, _, links, _ = make_service()
        opened = service.open_stream(add_request(service), "", 1, lambda: 0.01)
        with opened as stream:
            assert links[stream.worker].added[0].timeout_ms == pytest.approx(10.0)
            await asyncio.wait_for(stream.wait(), 1)
            assert stream.error[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert requests_total(service, "DEADLINE_EXCEEDED") == 1

    asyncio.run(run())
