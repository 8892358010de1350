"""The load generator: client processes that stream requests and record every chunk.

Each process owns its gRPC channels and event loop; processes start their first requests
together at an agreed monotonic time, so "N streams starting together" holds across them.
A request never raises out of the generator: its status code and message are recorded.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Callable

import grpc
import msgspec

from cadence.api.v1 import inference_pb2 as pb
from cadence.api.v1 import inference_pb2_grpc as pb_grpc
from cadence.lab.records import RequestRecord


class RequestPlan(msgspec.Struct, frozen=True, array_like=True):
    """One request to send."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


class ProcessPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one load-generating process needs."""

    process: int
    target: str
    requests: list[RequestPlan]
    concurrency: int
    """Streams this process keeps open at once (closed loop)."""
    start_at_ns: int
    """Monotonic time at which the first requests go out."""
    include_timing: bool = True
    timeout_s: float | None = None
    channels: int = 1
    warmup: int = 0
    """Requests sent (and not recorded) before start_at_ns."""
    read_delay_ms: float = 0.0
    """Sleep this long after each chunk: a slow-reading client, to test backpressure."""


async def _one(stub: pb_grpc.InferenceStub, plan: RequestPlan, process: int,
               include_timing: bool, timeout: float | None,
               read_delay_s: float = 0.0) -> RequestRecord:
    request = pb.GenerateRequest(
        request_id=plan.request_id,
        prompt_token_ids=plan.prompt_token_ids,
        max_tokens=plan.max_tokens,
        include_timing=include_timing,
    )
    monotonic_ns = time.monotonic_ns
    record = RequestRecord(
        request_id=plan.request_id,
        process=process,
        start_ns=monotonic_ns(),
        max_tokens=plan.max_tokens,
        prompt_tokens=len(plan.prompt_token_ids),
    )
    arrival, tokens, index = record.arrival_ns, record.tokens, record.index
    starts, ends, recvs, sends = (
        record.t_step_start_ns, record.t_step_end_ns, record.t_front_recv_ns, record.t_send_ns
    )
    call = stub.Generate(request, timeout=timeout)
    try:
        async for chunk in call:
            arrival.append(monotonic_ns())
            tokens.append(len(chunk.token_ids))
            index.append(chunk.index)
            if include_timing:
                t = chunk.timing
                starts.append(t.step_start_ns)
                ends.append(t.step_end_ns)
                recvs.append(t.front_recv_ns)
                sends.append(t.send_ns)
                if chunk.index == 0:
                    record.t_received_ns = t.received_ns
                    record.t_scheduled_ns = t.scheduled_ns
            if chunk.finish_reason:
                record.finish_reason = chunk.finish_reason
            if read_delay_s:
                await asyncio.sleep(read_delay_s)
    except grpc.aio.AioRpcError as exc:
        record.code = exc.code().name
        record.error = exc.details() or ""
    except Exception as exc:  # recorded, never raised: one request must not stop the run
        record.code = "CLIENT_ERROR"
        record.error = repr(exc)
    record.end_ns = monotonic_ns()
    return record


async def _run_process(plan: ProcessPlan) -> tuple[list[RequestRecord], float, float]:
    channels = [
        grpc.aio.insecure_channel(plan.target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(plan.channels)
    ]
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), 30)
    stubs = [pb_grpc.InferenceStub(c) for c in channels]
    for i in range(plan.warmup):
        await _one(stubs[i % len(stubs)], RequestPlan(f"warmup-{plan.process}-{i}", [1, 2, 3], 4),
                   plan.process, plan.include_timing, plan.timeout_s)
    delay = (plan.start_at_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        await asyncio.sleep(delay)
    cpu0, wall0 = time.process_time(), time.monotonic()
    queue = list(reversed(plan.requests))
    records: list[RequestRecord] = []

    async def lane(k: int) -> None:
        stub = stubs[k % len(stubs)]
        while queue:
            records.append(await _one(stub, queue.pop(), plan.process, plan.include_timing,
                                      plan.timeout_s, plan.read_delay_ms / 1e3))

    await asyncio.gather(*(lane(k) for k in range(min(plan.concurrency, len(plan.requests)))))
    cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - wall0
    for channel in channels:
        await channel.close()
    return records, cpu_s, wall_s


class ProcessResult(msgspec.Struct, array_like=True):
    """What one load process sends back: its records and the CPU it spent on them."""

    process: int
    records: list[RequestRecord]
    cpu_s: float
    """User + system CPU of the process from the agreed start to its last record."""
    wall_s: float


async def _measured(plan: ProcessPlan) -> ProcessResult:
    records, cpu_s, wall_s = await _run_process(plan)
    return ProcessResult(plan.process, records, cpu_s, wall_s)


def _process_main(plan_bytes: bytes, conn) -> None:
    plan = msgspec.msgpack.decode(plan_bytes, type=ProcessPlan)
    try:
        import uvloop

        result = uvloop.run(_measured(plan))
    except ImportError:
        result = asyncio.run(_measured(plan))
    conn.send_bytes(msgspec.msgpack.encode(result))
    conn.close()


def run_load(plans: list[ProcessPlan],
             on_started: Callable[[int, int], None] | None = None) -> list[ProcessResult]:
    """Run each plan in its own process and gather every process's result.

    `on_started(process_number, pid)` is called for each process once it runs.
    """
    context = mp.get_context("spawn")
    started = []
    for plan in plans:
        receiver, sender = context.Pipe(duplex=False)
        proc = context.Process(target=_process_main, args=(msgspec.msgpack.encode(plan), sender))
        proc.start()
        sender.close()
        started.append((proc, receiver))
        if on_started is not None:
            on_started(plan.process, proc.pid)
    decode = msgspec.msgpack.Decoder(ProcessResult).decode
    results: list[ProcessResult] = []
    for proc, receiver in started:
        try:
            results.append(decode(receiver.recv_bytes()))
        except EOFError:
            raise RuntimeError(f"load process {proc.pid} died (exit status {proc.exitcode})")
        finally:
            proc.join()
    return results
