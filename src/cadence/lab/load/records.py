"""What the load generator records for each request: raw, per chunk, never aggregated."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
import msgspec

if TYPE_CHECKING:
    from cadence.lab.load.plan import RequestPlan


class RequestRecord(msgspec.Struct, array_like=True, kw_only=True):
    """One request as the client saw it. Times are `time.monotonic_ns()` on the client host.

    Per-chunk lists are parallel: chunk i arrived at `arrival_ns[i]` with `tokens[i]`
    tokens at output position `index[i]`. The `t_*` lists hold the server's Timing of
    each chunk when the request asked for it (else they are empty).
    """

    request_id: str
    process: int
    start_ns: int
    """Just before the request was sent."""
    end_ns: int = 0
    """When the stream ended (last chunk or error)."""
    code: str = "OK"
    """gRPC status code name."""
    error: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    finish_reason: int = 0
    arrival_ns: list[int] = []
    tokens: list[int] = []
    index: list[int] = []
    worker: int = -1
    """The worker that served it (with timing; -1 without)."""
    t_received_ns: int = 0
    t_scheduled_ns: int = 0
    t_step_start_ns: list[int] = []
    t_step_end_ns: list[int] = []
    t_front_recv_ns: list[int] = []
    t_send_ns: list[int] = []
    loop_lag: list[str] = []
    """With timing, from cadence: the front's loop-lag tally at the stream's start and end
    (`cadence.core.metrics.LoopLagTally.encoded`); empty from other servers."""
    trace_id: str = ""
    """The W3C trace id the request was sent with (`traceparent`, 32 hex digits): a traced
    server's span for it carries the same id (`cadence bench --otlp-receive`)."""
    connect_ns: int = -1
    """HTTP: how long this request waited for a new connection to be made (TCP connect and,
    over https, the TLS handshake), a part of its TTFT; 0 when it went on a connection that
    was already open. -1: not measured (gRPC opens its channels before the run)."""
    scheduled_ns: int = 0
    """Open loop (a rate, a trace): when the schedule meant the request to go; `start_ns`
    minus it is its dispatch delay. 0 in a closed loop."""
    turn: int = 0
    """Its turn in its conversation (1 first); 0 outside one."""
    cached_tokens: int = -1
    """Prompt tokens the server says it had cached (OpenAI `usage.prompt_tokens_details.
    cached_tokens`, cadence.v1's and KServe's `cached_tokens`); -1: the server did not say."""

    @property
    def output_tokens(self) -> int:
        return sum(self.tokens)


def sent(plan: RequestPlan, process: int) -> RequestRecord:
    """The record of `plan`, its start stamped now: make it just before the request goes."""
    return RequestRecord(request_id=plan.request_id, process=process,
                         start_ns=time.monotonic_ns(), max_tokens=plan.max_tokens,
                         prompt_tokens=len(plan.prompt_token_ids), trace_id=os.urandom(16).hex())


def traceparent(record: RequestRecord) -> str:
    """The W3C `traceparent` that starts `record`'s trace: its trace id, a fresh parent span
    id, sampled (so a server that follows its caller's sampling decision records it)."""
    return f"00-{record.trace_id}-{os.urandom(8).hex()}-01"


STALLED = "STALLED"
"""The code of a request ended by the stall limit (`recording`)."""


@contextlib.contextmanager
def recording(record: RequestRecord, stall_s: float | None = None) -> Iterator[RequestRecord]:
    """Around one request's stream: an error is recorded, never raised (one request must not
    stop the run), and the end time is stamped however the stream ends. With `stall_s`, a
    request that gets no chunk for that long (the first counted from its start) is ended,
    as STALLED: a server that stops answering must not hold the run for ever."""
    stall = _StallWatch(record, stall_s) if stall_s else None
    try:
        yield record
    except asyncio.CancelledError:
        if stall is None or not stall.fired:
            raise
        stall.task.uncancel()
        record.code = STALLED
        record.error = (f"no message for {stall_s:g} s (after {len(record.arrival_ns)}): "
                        "ended by the stall limit (cadence bench --stall-limit)")
    except grpc.aio.AioRpcError as exc:
        record.code = exc.code().name
        record.error = exc.details() or ""
    except Exception as exc:
        record.code = "CLIENT_ERROR"
        record.error = repr(exc)
    finally:
        if stall is not None:
            stall.handle.cancel()
        record.end_ns = time.monotonic_ns()


class _StallWatch:
    """Cancels the task reading a request once it has had no chunk for `stall_s`. It looks
    at the record's arrival stamps on a timer, re-armed at most once per `stall_s`, so the
    reading loop pays nothing per chunk."""

    def __init__(self, record: RequestRecord, stall_s: float) -> None:
        self.task = asyncio.current_task()
        self.fired = False
        self._record = record
        self._stall_ns = int(stall_s * 1e9)
        self._loop = asyncio.get_running_loop()
        self.handle = self._loop.call_later(stall_s, self._check)

    def _check(self) -> None:
        arrivals = self._record.arrival_ns
        last = arrivals[-1] if arrivals else self._record.start_ns
        left_ns = last + self._stall_ns - time.monotonic_ns()
        if left_ns > 0:
            self.handle = self._loop.call_later(left_ns / 1e9, self._check)
            return
        self.fired = True
        self.task.cancel()
