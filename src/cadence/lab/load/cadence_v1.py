"""The cadence.v1 driver: one `Generate` stream per request, its chunks decoded after the run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import msgspec

from cadence.lab.load.driver import ChannelDriver
from cadence.lab.load.plan import RequestPlan
from cadence.lab.load.recording import recording, sent, traceparent
from cadence.lab.records import RequestRecord
from cadence.proto import loop_lag as loop_lag_metadata
from cadence.proto.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from cadence.lab.results import Workload

GENERATE = "/cadence.v1.Inference/Generate"
_CACHED_TOKENS = "cached_tokens" in pb.GenerateChunk.DESCRIPTOR.fields_by_name
"""Whether this build's protocol carries the last chunk's cached prompt tokens."""


class CadenceTarget(msgspec.Struct, frozen=True, tag="cadence"):
    """cadence's own protocol: `cadence.v1.Inference/Generate`, with server timing."""

    CADENCE_SERVER: ClassVar[bool] = True
    HTTP2_SETTINGS: ClassVar[bool] = True
    SERVER_TIMING: ClassVar[bool] = True

    def driver(self) -> CadenceDriver:
        return CadenceDriver()

    def address(self, target: str) -> str:
        return target

    def describe(self, workload: Workload) -> None:
        pass


CADENCE = CadenceTarget()
"""The default target: cadence's own protocol."""


class CadenceDriver(ChannelDriver):
    def stub(self, channel) -> Callable:
        return generate_method(channel)

    async def one(
        self, request: RequestPlan, process: int, lane: int
    ) -> tuple[RequestRecord, list[bytes]]:
        s = self.session
        return await one_cadence(
            self.stubs[lane % len(self.stubs)],
            request,
            process,
            s.include_timing,
            *s.for_request(request),
            s.stall_s,
        )

    def decode(self, record: RequestRecord, chunks: list[bytes]) -> None:
        decode_chunks(record, chunks, self.session.include_timing)


def generate_method(channel) -> Callable:
    """`Generate` on `channel`, answering each chunk as its serialized bytes.

    The load generator parses chunks after the run (`decode_chunks`), not as they arrive:
    between two arrivals it only stamps the time and keeps the bytes, which is about a fifth
    less CPU per chunk than parsing there and keeps one process ahead of 30,000 chunks/s.
    """
    return channel.unary_stream(GENERATE, request_serializer=pb.GenerateRequest.SerializeToString)


async def one_cadence(
    generate: Callable,
    plan: RequestPlan,
    process: int,
    include_timing: bool,
    timeout: float | None,
    read_delay_s: float = 0.0,
    stall_s: float | None = None,
) -> tuple[RequestRecord, list[bytes]]:
    request = pb.GenerateRequest(
        request_id=plan.request_id,
        prompt_token_ids=plan.prompt_token_ids,
        max_tokens=plan.max_tokens,
        include_timing=include_timing,
    )
    monotonic_ns = time.monotonic_ns
    record = sent(plan, process)
    arrival = record.arrival_ns
    chunks: list[bytes] = []
    keep = chunks.append
    call = generate(
        request, timeout=timeout, metadata=(("traceparent", traceparent(record)), *plan.headers)
    )
    with recording(record, stall_s, plan.cancel_s):
        async for chunk in call:
            arrival.append(monotonic_ns())
            keep(chunk)
            if read_delay_s:
                await asyncio.sleep(read_delay_s)
        if include_timing:
            record.loop_lag = loop_lag(
                await call.initial_metadata(), await call.trailing_metadata()
            )
    return record, chunks


def loop_lag(initial, trailing) -> list[str]:
    """The front's loop-lag tally at a stream's start ("" when the server sent none: it
    sends it only when it moved since another stream carried it) and at its end; [] without
    the end's."""
    start = next((v for k, v in initial or () if k == loop_lag_metadata.KEY), "")
    end = next((v for k, v in trailing or () if k == loop_lag_metadata.KEY), None)
    return [start, end] if end is not None else []


def decode_chunks(record: RequestRecord, chunks: list[bytes], include_timing: bool) -> None:
    """Fill the record's per-chunk fields from the chunks `one_cadence` kept, in arrival order."""
    parse = pb.GenerateChunk.FromString
    tokens, index = record.tokens, record.index
    starts, ends, recvs, sends = (
        record.t_step_start_ns,
        record.t_step_end_ns,
        record.t_front_recv_ns,
        record.t_send_ns,
    )
    waits: list[int] = []
    for data in chunks:
        chunk = parse(data)
        tokens.append(chunk.outputs or len(chunk.token_ids))  # a model's text pieces: outputs
        index.append(chunk.index)
        if include_timing:
            t = chunk.timing
            starts.append(t.step_start_ns)
            ends.append(t.step_end_ns)
            recvs.append(t.front_recv_ns)
            sends.append(t.send_ns)
            waits.append(t.step_cpu_wait_ns if t.HasField("step_cpu_wait_ns") else -1)
            if chunk.index == 0:
                record.worker = t.worker
                record.t_received_ns = t.received_ns
                record.t_scheduled_ns = t.scheduled_ns
            if t.handoff_ns:  # handed to a decode worker
                record.note_handoff(t.worker, t.prefill_worker, t.handoff_ns)
        if chunk.finish_reason:
            record.finish_reason = chunk.finish_reason
            if _CACHED_TOKENS:
                record.cached_tokens = chunk.cached_tokens
    if any(w >= 0 for w in waits):
        record.t_step_cpu_wait_ns = waits
