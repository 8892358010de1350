"""Recording a request as it runs: its record made as it is sent, its trace context, errors and
the stall limit turned into the record's code and end time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from cadence.lab.records import CLIENT_CANCELLED, RequestRecord

if TYPE_CHECKING:
    from cadence.lab.load.plan import RequestPlan


def sent(plan: RequestPlan, process: int) -> RequestRecord:
    """The record of `plan`, its start stamped now: make it just before the request goes."""
    return RequestRecord(
        request_id=plan.request_id,
        process=process,
        start_ns=time.monotonic_ns(),
        max_tokens=plan.max_tokens,
        prompt_tokens=len(plan.prompt_token_ids),
        trace_id=os.urandom(16).hex(),
        turn=plan.turn,
        population=plan.population,
        request_class=plan.request_class,
    )


def traceparent(record: RequestRecord) -> str:
    """The W3C `traceparent` that starts `record`'s trace: its trace id, a fresh parent span
    id, sampled (so a server that follows its caller's sampling decision records it)."""
    return f"00-{record.trace_id}-{os.urandom(8).hex()}-01"


STALLED = "STALLED"
"""The code of a request ended by the stall limit (`recording`)."""


@contextlib.contextmanager
def recording(
    record: RequestRecord, stall_s: float | None = None, cancel_s: float = 0.0
) -> Iterator[RequestRecord]:
    """Around one request's stream: an error is recorded, never raised (one request must not
    stop the run), and the end time is stamped however the stream ends. With `stall_s`, a
    request that gets no chunk for that long (the first counted from its start) is ended,
    as STALLED: a server that stops answering must not hold the run for ever. With
    `cancel_s`, the client cancels the request that long after its send, as a user who
    gives up would (CLIENT_CANCELLED), unless it ended before."""
    stall = _StallWatch(record, stall_s) if stall_s else None
    cancel = _Cancel(cancel_s) if cancel_s else None
    try:
        yield record
    except asyncio.CancelledError:
        if cancel is not None and cancel.fired:
            cancel.task.uncancel()
            record.code = CLIENT_CANCELLED
            record.error = (
                f"cancelled by the client {cancel_s * 1e3:g} ms after its send, "
                f"after {len(record.arrival_ns)} messages (--cancel-ms)"
            )
            return
        if stall is None or not stall.fired:
            raise
        stall.task.uncancel()
        record.code = STALLED
        record.error = (
            f"no message for {stall_s:g} s (after {len(record.arrival_ns)}): "
            "ended by the stall limit (cadence bench --stall-limit)"
        )
    except grpc.aio.AioRpcError as exc:
        record.code = exc.code().name
        record.error = exc.details() or ""
    except Exception as exc:
        record.code = "CLIENT_ERROR"
        record.error = repr(exc)
    finally:
        if stall is not None:
            stall.handle.cancel()
        if cancel is not None:
            cancel.handle.cancel()
        record.end_ns = time.monotonic_ns()


def _reading_task() -> asyncio.Task:
    """The task reading the request: `recording` is entered by a request's coroutine."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("recording() with a stall limit or a cancel time runs in a task")
    return task


class _Cancel:
    """Cancels the task reading a request `cancel_s` after it was sent."""

    def __init__(self, cancel_s: float) -> None:
        self.task = _reading_task()
        self.fired = False
        self.handle = asyncio.get_running_loop().call_later(cancel_s, self._fire)

    def _fire(self) -> None:
        self.fired = True
        self.task.cancel()


class _StallWatch:
    """Cancels the task reading a request once it has had no chunk for `stall_s`. It looks
    at the record's arrival stamps on a timer, re-armed at most once per `stall_s`, so the
    reading loop pays nothing per chunk."""

    def __init__(self, record: RequestRecord, stall_s: float) -> None:
        self.task = _reading_task()
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
