"""Timestamps of a worker on another host are moved onto the front's clock by heartbeats."""

from __future__ import annotations

from cadence.core.metrics import FrontMetrics
from cadence.core.output_reader import _OFFSET_WINDOW, OutputReader
from cadence.transport.messages import Heartbeat, WorkerReady, boot_id


def _reader() -> OutputReader:
    return OutputReader({}, lambda message: None, FrontMetrics(), 2)


def test_a_worker_on_this_host_keeps_its_timestamps() -> None:
    reader = _reader()
    reader.handle(WorkerReady(0, 1, "synthetic", boot_id=boot_id()), 0)
    reader.handle(Heartbeat(0, 1_000), 5_000_000)
    assert reader.clock_offset_ns[0] == 0
    assert reader.last_heard_ns[0] == 5_000_000


def test_a_foreign_worker_gets_the_least_trip_over_a_window() -> None:
    reader = _reader()
    reader.handle(WorkerReady(1, 1, "synthetic", boot_id="another-host"), 0)
    skew = 10**12  # the other host booted long before this one
    reader.handle(Heartbeat(1, 100), 100 + skew + 900)  # the first estimate is used at once
    assert reader.clock_offset_ns[1] == skew + 900
    trips = [700, 300, 5_000] + [2_000] * (_OFFSET_WINDOW - 4)
    for i, trip in enumerate(trips):
        sent = 1_000_000 * (i + 1)
        reader.handle(Heartbeat(1, sent), sent + skew + trip)
    assert reader.clock_offset_ns[1] == skew + 300  # the fastest beat of the window
    assert reader.clock_offset_ns[0] == 0
