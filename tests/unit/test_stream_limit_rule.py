"""`server_stream_limit`: the server's HTTP/2 stream limit against the streams the client put
on one connection, and refused streams read from the calls' errors."""

from __future__ import annotations

from pathlib import Path

import msgspec

from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.report.run import render_report
from cadence.lab.report.summary import http2_line
from cadence.lab.results import BenchResult, Http2Settings


def result(limit: int | None, concurrency: int = 16, channels: int = 1, processes: int = 1,
           errors: dict[str, tuple[int, str]] | None = None) -> BenchResult:
    """A run of `concurrency` streams over `processes` x `channels` connections, against a
    server whose stream limit is `limit`; `errors`: {code: (count, first message)}."""
    errors = errors or {}
    return msgspec.convert({
        "requests": concurrency,
        "requests_ok": concurrency - sum(n for n, _ in errors.values()),
        "errors_by_code": {code: n for code, (n, _) in errors.items()},
        "first_error_by_code": {code: m for code, (_, m) in errors.items()},
        "workload": {"concurrency": concurrency, "channels_per_process": channels,
                     "client_processes": processes, "protocol": "grpc"},
        "http2": {"max_concurrent_streams": limit},
    }, BenchResult)


def findings(r: BenchResult) -> dict[str, object]:
    return {f.rule: f for f in diagnose(r)}


def test_more_streams_per_connection_than_the_limit_is_named_with_the_channels_needed() -> None:
    found = findings(result(4, concurrency=16))["server_stream_limit"]
    assert found.evidence["streams_per_connection"] == 16
    assert found.evidence["server_max_concurrent_streams"] == 4
    assert "--channels 4" in found.look_at
    two_procs = findings(result(4, concurrency=16, processes=2))["server_stream_limit"]
    assert two_procs.evidence["streams_per_connection"] == 8 and "--channels 2" in two_procs.look_at


def test_silent_within_the_limit_or_without_one() -> None:
    assert "server_stream_limit" not in findings(result(4, concurrency=16, channels=4))
    assert "server_stream_limit" not in findings(result(None, concurrency=512))
    assert "server_stream_limit" not in findings(msgspec.convert({}, BenchResult))


def test_refused_streams_are_named_even_without_the_settings() -> None:
    message = "Stream removed (RST_STREAM (Received RST_STREAM with error code 7))"
    found = findings(result(None, errors={"UNAVAILABLE": (3, message)}))
    assert "REFUSED_STREAM" in found["server_stream_limit"].finding
    assert found["server_stream_limit"].evidence["refused_calls"] == 3
    other = findings(result(None, errors={"UNAVAILABLE": (3, "connection reset")}))
    assert "server_stream_limit" not in other


def test_the_settings_in_the_summary_and_the_report(tmp_path: Path) -> None:
    line = http2_line(Http2Settings(max_concurrent_streams=4, initial_window_size=1 << 20))
    assert line == ("HTTP/2 settings of the server: at most 4 streams per connection, initial "
                    "window 1,048,576 B, max frame 16,384 B (default)")
    assert "not read (ConnectionRefusedError" in http2_line(
        Http2Settings(error="ConnectionRefusedError: [Errno 111] Connection refused"))
    page = render_report(result(4), tmp_path).read_text()
    assert "Server&#x27;s HTTP/2 settings" in page or "Server's HTTP/2 settings" in page
    assert "<td>max concurrent streams per connection</td><td>4</td>" in page
