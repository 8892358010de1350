"""The load generator: client processes that stream requests and record every chunk.

Each process owns its gRPC channels and event loop; processes start their first requests
together at an agreed monotonic time, so "N streams starting together" holds across them.
A request never raises out of the generator: its status code and message are recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing as mp
import time
from collections.abc import Callable

import msgspec

from cadence import event_loop
from cadence.credentials import ClientCredentials
from cadence.heap import settle_heap
from cadence.lab.load.cadence_v1 import CADENCE
from cadence.lab.load.driver import Session
from cadence.lab.load.loop_lateness import LoopLateness
from cadence.lab.load.plan import RequestPlan, RequestShape, poisson_offsets
from cadence.lab.load.saturation import SaturationWatch
from cadence.lab.load.target import Target
from cadence.lab.records import CLIENT_CANCELLED, ProcessResult, RequestRecord


class ProcessPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one load-generating process needs.

    The process sends requests i = process, process + processes, ... of the run. Closed
    loop: `concurrency` streams open at once. Open loop (`rate` set): each request goes out
    at its precomputed arrival time, whatever is still open.
    """

    process: int
    processes: int = 1
    target: str
    shape: RequestShape
    requests: int | None
    """Requests in the whole run (None: until duration_s)."""
    duration_s: float | None = None
    """Stop sending new requests after this long."""
    concurrency: int = 1
    """Streams this process keeps open at once (closed loop)."""
    rate: float | None = None
    """Requests per second of the whole run (open loop)."""
    stages: list[tuple[float, float, float]] = []
    """Open loop: the rate's ramps and steps, (rate at start, rate at end, seconds) each
    (`poisson_offsets`); empty: `rate` throughout."""
    warmup_s: float = 0.0
    """The requests sent in the run's first seconds are not recorded (a warm-up by time)."""
    include_timing: bool = True
    timeout_s: float | None = None
    stall_s: float | None = None
    """End a request that gets no chunk for this long (None: never)."""
    channels: int = 1
    warmup: int = 0
    """Requests sent (and not recorded) before start_at_ns."""
    read_delay_ms: float = 0.0
    """Sleep this long after each chunk: a slow-reading client, to test backpressure."""
    credentials: ClientCredentials | None = None
    """TLS roots, client certificate, bearer token; None: a plaintext channel."""
    protocol: Target = CADENCE
    """What the requests speak (lab/load/target.py)."""
    saturation_window_s: float = 0.0
    """Open loop with stages: end the run once the server no longer keeps up, judged over
    windows this long (`cadence.lab.load.saturation`); 0: never."""


def my_requests(plan: ProcessPlan):
    """(i, arrival offset in s or None) for this process's share of the run (the baseline
    server replays the same share: `servers/baseline.py`)."""
    trace = plan.shape.trace
    offsets = (
        iter([row.offset_s for row in trace])
        if trace
        else poisson_offsets(plan.rate, plan.shape.seed, plan.stages)
        if plan.rate
        else None
    )
    requests = plan.requests
    if trace:
        requests = len(trace) if requests is None else min(requests, len(trace))
    i = 0
    while requests is None or i < requests:
        offset = next(offsets, None) if offsets is not None else None
        if offsets is not None and offset is None:  # the trace or the last stage ended
            return
        if plan.duration_s is not None and offset is not None and offset > plan.duration_s:
            return
        if i % plan.processes == plan.process:
            yield i, offset
        i += 1


class FailureStreak:
    """The rule that stops a run early: a process stops sending once at least
    `FAILURES` requests in a row have failed AND none has succeeded for `QUIET_S` seconds
    (counted from the run's start when none ever did).

    Both must hold: a short burst of quick failures (a worker restarting, a shed wave) is
    what the run is there to show, so it does not stop the run; a long stretch of slow
    failures (a few requests timing out) is not stopped on time alone either. Requests
    still open when the rule fires run to their end and are recorded.
    """

    FAILURES = 20
    QUIET_S = 3.0

    def __init__(self, started: float) -> None:
        self._failures = 0
        self._last_ok = started
        self.reason: str | None = None
        """One line saying why the run stopped; None while it goes on."""

    def add(self, record: RequestRecord) -> None:
        now = time.monotonic()
        if record.code == "OK":
            self._failures, self._last_ok = 0, now
            return
        if record.code == CLIENT_CANCELLED:  # the client's doing: neither failure nor success
            return
        self._failures += 1
        quiet = now - self._last_ok
        if self.reason is None and self._failures >= self.FAILURES and quiet >= self.QUIET_S:
            error = record.error.splitlines()[0] if record.error else ""
            self.reason = (
                f"stopped early: {self._failures} requests in a row failed and none "
                f"succeeded for {quiet:.1f} s (last: {record.code}"
                + (f": {error})" if error else ")")
            )


async def _run_process(
    plan: ProcessPlan, ready: Callable[[], int], completed=None
) -> ProcessResult:
    """Connect, warm up, report `ready()` (which returns the agreed start time), then run.
    `completed` (a shared c_longlong, or None) gets one added per measured request."""
    driver = plan.protocol.driver()
    await driver.connect(
        Session(
            address=plan.target,
            channels=plan.channels,
            credentials=plan.credentials,
            include_timing=plan.include_timing,
            timeout_s=plan.timeout_s,
            read_delay_s=plan.read_delay_ms / 1e3,
            stall_s=plan.stall_s,
        )
    )
    for i in range(plan.warmup):
        await driver.one(RequestPlan(f"warmup-{plan.process}-{i}", [1, 2, 3], 4), plan.process, i)
    # The closed loop's first wave starts at one instant: its requests are made now, so that
    # making one does not hold up the sending of the others.
    open_loop = bool(plan.rate or plan.shape.trace)
    conversation = plan.shape.conversation
    todo = my_requests(plan) if conversation is None else iter(())
    head = [] if open_loop else list(itertools.islice(todo, plan.concurrency))
    todo = itertools.chain(head, todo)
    made = {i: plan.shape.request(i) for i, _ in head}
    driver.prepare(made.values())
    settle_heap()  # a full collection during the run would stall every stream it records
    start_at_ns = await asyncio.get_running_loop().run_in_executor(None, ready)
    delay = (start_at_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        await asyncio.sleep(delay)
    cpu0, wall0, started_ns = time.process_time(), time.monotonic(), time.monotonic_ns()
    lateness = LoopLateness().start()
    kept: list[tuple[RequestRecord, list[bytes]]] = []
    """Each request's record and its chunks' bytes, parsed after the run."""
    stop_at = wall0 + plan.duration_s if plan.duration_s is not None else float("inf")
    streak = FailureStreak(wall0)
    slips, lags = 0, []
    watch = (
        SaturationWatch(plan.saturation_window_s, plan.stages, plan.processes)
        if plan.saturation_window_s and open_loop
        else None
    )

    async def send(i: int, lane: int, intended_ns: int | None = None) -> None:
        request = made.pop(i, None) or plan.shape.request(i)
        record, chunks = await driver.one(request, plan.process, lane)
        if watch is not None:
            watch.ended(
                (record.end_ns - started_ns) / 1e9,
                (record.arrival_ns[0] - record.start_ns) / 1e6 if record.arrival_ns else math.nan,
            )
        kept.append((record, chunks))
        streak.add(record)
        if intended_ns is not None:
            record.scheduled_ns = intended_ns
            lags.append((record.start_ns - intended_ns) / 1e6)
        if completed is not None:
            # Per request, never per chunk: all the progress display costs this process.
            completed.value += 1

    if open_loop:
        # Open loop: sleep to each arrival time on the monotonic clock, the request made
        # (and serialized) before the sleep so that making it does not delay its send. A
        # Poisson run that falls behind shifts the rest of its schedule later instead of
        # bursting to catch up; a trace keeps its times (a late request goes at once). The
        # lag is measured against the unshifted schedule either way.
        shift = not plan.shape.trace
        base = started_ns / 1e9
        tasks = []
        for n, (i, offset) in enumerate(todo):
            made[i] = plan.shape.request(i)
            driver.prepare((made[i],))
            delay = base + offset - time.monotonic()
            if delay > 0:
                await _sleep_until(base + offset, delay)
            elif delay < -0.001:
                slips += 1
                if shift:
                    base -= delay
            if streak.reason is not None:
                break
            if watch is not None:
                if watch.stop(time.monotonic() - wall0):
                    break
                watch.sent(offset)
            tasks.append(asyncio.ensure_future(send(i, n, started_ns + int(offset * 1e9))))
        await asyncio.gather(*tasks)
    elif conversation is not None:

        async def session(s: int) -> None:
            for turn in range(conversation.turns):
                await send(s * conversation.turns + turn, s)
                if time.monotonic() >= stop_at or streak.reason is not None:
                    return
                if conversation.think_ms and turn + 1 < conversation.turns:
                    # Not a bare timer: the loop's timers may wake a fraction of a ms early.
                    think_s = conversation.think_ms / 1e3
                    await _sleep_until(time.monotonic() + think_s, think_s)

        mine = range(plan.process, conversation.sessions, plan.processes)
        await asyncio.gather(*(session(s) for s in mine))
    else:

        async def lane(k: int) -> None:
            for i, _ in todo:
                await send(i, k)
                if time.monotonic() >= stop_at or streak.reason is not None:
                    return

        await asyncio.gather(*(lane(k) for k in range(plan.concurrency)))
    cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - wall0
    await lateness.stop()
    if plan.warmup_s:
        counted_from = started_ns + int(plan.warmup_s * 1e9)
        counted = [k for k, (record, _) in enumerate(kept) if record.start_ns >= counted_from]
        kept, lags = [kept[k] for k in counted], [lags[k] for k in counted] if lags else []
    for record, chunks in kept:
        driver.decode(record, chunks)
    await driver.close()
    return ProcessResult(
        plan.process,
        [record for record, _ in kept],
        cpu_s,
        wall_s,
        slips,
        started_ns,
        lags,
        streak.reason,
        watch.result if watch is not None else None,
        lateness.late_ms.tolist(),
        lateness.stalls,
    )


_SPIN_S = 0.0005
"""The last stretch before an open-loop send is waited out by yielding to the loop, not by a
timer: the loop's timers keep milliseconds and wake up to one late. Longer, the process
spins more and, on a busy host, is preempted more (docs/lab.md, "Replaying a trace")."""


async def _sleep_until(at: float, delay: float) -> None:
    """Sleep until monotonic time `at` (`delay` seconds from now), to well under a
    millisecond: a timer for all but the last stretch, then turns of the loop (other streams
    are read in between)."""
    if delay > _SPIN_S:
        await asyncio.sleep(delay - _SPIN_S)
    while time.monotonic() < at:
        await asyncio.sleep(0)


def _process_main(plan_bytes: bytes, conn, completed=None) -> None:
    plan = msgspec.msgpack.decode(plan_bytes, type=ProcessPlan)

    def ready() -> int:
        conn.send_bytes(b"ready")
        return int(conn.recv_bytes())

    result = event_loop.run(_run_process(plan, ready, completed))
    conn.send_bytes(msgspec.msgpack.encode(result))
    conn.close()


class RequestCounter:
    """Requests the load processes have finished so far, for a progress display.

    Each process adds one to its own slot of shared memory as a request ends: one writer per
    slot, so no lock and nothing sent; `completed` sums the slots whenever the parent looks.
    The count is of measured requests (not warm-up), errors included, like the records.
    """

    def __init__(self) -> None:
        self._slots: list = []
        self.started_ns: int | None = None
        """The agreed start (time.monotonic_ns), once every process is ready; else None."""

    def slot(self, context) -> object:
        """A new process's slot: a c_longlong in shared memory, made by `context`."""
        slot = context.RawValue("q", 0)
        self._slots.append(slot)
        return slot

    @property
    def completed(self) -> int:
        """Requests finished so far, over every process (read from any thread)."""
        return sum(slot.value for slot in self._slots)


_START_MARGIN_NS = 20_000_000
"""Between the last process reporting ready and the agreed start, so all are waiting."""


def run_load(
    plans: list[ProcessPlan],
    on_started: Callable[[int, int], None] | None = None,
    counter: RequestCounter | None = None,
    on_start: Callable[[], None] | None = None,
) -> list[ProcessResult]:
    """Run each plan in its own process and gather every process's result.

    `on_started(process_number, pid)` is called for each process once it runs. Every process
    connects and warms up first; then all start at one agreed monotonic time, just after
    `on_start()` (measurements of the run proper begin there). `counter` counts their
    finished requests as they go (a progress bar reads it).
    """
    context = mp.get_context("spawn")
    started = []
    for plan in plans:
        here, there = context.Pipe()
        completed = counter.slot(context) if counter is not None else None
        proc = context.Process(
            target=_process_main, args=(msgspec.msgpack.encode(plan), there, completed)
        )
        proc.start()
        assert proc.pid is not None  # set by start()
        there.close()
        started.append((proc, here))
        if on_started is not None:
            on_started(plan.process, proc.pid)
    decode = msgspec.msgpack.Decoder(ProcessResult).decode
    results: list[ProcessResult] = []
    try:
        for proc, conn in started:
            if _expect(conn.recv_bytes, proc) != b"ready":
                raise RuntimeError(f"load process {proc.pid} did not report ready")
        if on_start is not None:
            on_start()
        start_at_ns = time.monotonic_ns() + _START_MARGIN_NS
        if counter is not None:
            counter.started_ns = start_at_ns
        start_at = str(start_at_ns).encode()
        for _, conn in started:
            conn.send_bytes(start_at)
        for proc, conn in started:
            results.append(decode(_expect(conn.recv_bytes, proc)))
    finally:
        for proc, _ in started:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    return results


def _expect(recv: Callable[[], bytes], proc) -> bytes:
    try:
        return recv()
    except EOFError:
        proc.join(timeout=5)
        raise RuntimeError(f"load process {proc.pid} died (exit status {proc.exitcode})") from None
