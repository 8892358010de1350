"""The rules on a server cadence did not write: `server_stream_limit` (its HTTP/2 stream limit
against the streams the client put on one connection, refused streams), and the rules on its
threads, `server_one_core_bound` and `server_threads_wait_for_cpu`."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.report.run import render_report
from cadence.lab.report.summary import http2_line
from cadence.lab.results import BenchResult, Distribution, HostCpu, Http2Settings, ProcessCpu


def result(
    limit: int | None,
    concurrency: int = 16,
    channels: int = 1,
    processes: int = 1,
    errors: dict[str, tuple[int, str]] | None = None,
) -> BenchResult:
    """A run of `concurrency` streams over `processes` x `channels` connections, against a
    server whose stream limit is `limit`; `errors`: {code: (count, first message)}."""
    errors = errors or {}
    return msgspec.convert(
        {
            "requests": concurrency,
            "requests_ok": concurrency - sum(n for n, _ in errors.values()),
            "errors_by_code": {code: n for code, (n, _) in errors.items()},
            "first_error_by_code": {code: m for code, (_, m) in errors.items()},
            "workload": {
                "concurrency": concurrency,
                "channels_per_process": channels,
                "client_processes": processes,
                "protocol": "grpc",
            },
            "http2": {"max_concurrent_streams": limit},
        },
        BenchResult,
    )


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
    assert line == (
        "HTTP/2 settings of the server: at most 4 streams per connection, initial "
        "window 1,048,576 B, max frame 16,384 B (default)"
    )
    assert "not read (ConnectionRefusedError" in http2_line(
        Http2Settings(error="ConnectionRefusedError: [Errno 111] Connection refused")
    )
    page = render_report(result(4), tmp_path).read_text()
    assert "Server&#x27;s HTTP/2 settings" in page or "Server's HTTP/2 settings" in page
    assert "<td>max concurrent streams per connection</td><td>4</td>" in page


def threads_result(
    processes: list[dict], groups: list[dict], cpus: int = 4, py_spy: bool | None = None
) -> BenchResult:
    return msgspec.convert(
        {
            "server_threads": {
                "wall_s": 2.0,
                "cpus": cpus,
                "threads": 8,
                "processes": processes,
                "groups": groups,
                "py_spy": py_spy,
            }
        },
        BenchResult,
    )


def test_one_core_bound_by_one_thread_or_by_the_gil() -> None:
    loop = {
        "pid": 7,
        "python": True,
        "threads": 6,
        "cpu_pct": 99.0,
        "busiest_thread": "python",
        "busiest_thread_cpu_pct": 97.0,
    }
    found = findings(threads_result([loop], []))["server_one_core_bound"]
    assert "one thread of the server (pid 7, 'python')" in found.finding
    gil = dict(loop, busiest_thread="ThreadPoolExecu", busiest_thread_cpu_pct=30.0)
    assert (
        "take turns on the GIL"
        in findings(threads_result([gil], []))["server_one_core_bound"].finding
    )
    native = dict(gil, python=False)  # a native server's threads can run at once
    assert "server_one_core_bound" not in findings(threads_result([native], []))
    spread = dict(loop, cpu_pct=190.0)  # on two cores: not held to one
    assert "server_one_core_bound" not in findings(threads_result([spread], []))
    assert "server_one_core_bound" not in findings(threads_result([loop], [], cpus=1))


def test_threads_that_wait_for_a_cpu_are_named() -> None:
    waiting = [
        {
            "name": "OMP_N",
            "threads": 8,
            "cpu_pct": 150.0,
            "wait_for_cpu_pct": 220.0,
            "involuntary_switches_per_s": 900.0,
        }
    ]
    found = findings(threads_result([], waiting, cpus=2))["server_threads_wait_for_cpu"]
    assert found.evidence["waited_cores"] == 2.2 and "OMP_N" in found.finding
    brief = [dict(waiting[0], wait_for_cpu_pct=40.0)]
    assert "server_threads_wait_for_cpu" not in findings(threads_result([], brief, cpus=2))
    # Running and waiting together within the host's cores: the waits are others' doing.
    assert "server_threads_wait_for_cpu" not in findings(threads_result([], waiting, cpus=8))


def test_a_server_that_fills_the_host_is_not_held_to_one_core() -> None:
    spinning = [
        {
            "pid": 10 + k,
            "python": True,
            "threads": 1,
            "cpu_pct": 95.0,
            "busiest_thread": "python",
            "busiest_thread_cpu_pct": 95.0,
        }
        for k in range(4)
    ]
    assert "server_one_core_bound" not in findings(threads_result(spinning, [], cpus=4))


def test_thread_groups_in_the_summary_say_what_py_spy_would_add() -> None:
    from cadence.lab.report import summary

    result = threads_result(
        [{"pid": 7, "python": True, "threads": 2, "cpu_pct": 50.0}],
        [
            {
                "name": "python",
                "threads": 2,
                "cpu_pct": 50.0,
                "busiest_thread_cpu_pct": 45.0,
                "wait_for_cpu_pct": 3.0,
            }
        ],
        py_spy=False,
    )
    lines = summary.thread_lines(result.server_threads)
    assert lines[0].startswith(
        "server threads (8 in 1 process(es), % of one core): python x2 "
        "50% (busiest 45%, waiting for a CPU 3%"
    )
    assert "pip install py-spy" in lines[-1]


@pytest.mark.parametrize("recorded", [True, None])
def test_the_py_spy_hint_is_what_the_bench_host_lacked_not_the_report_host(
    recorded: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The result says whether the bench's host had py-spy; the report probes nothing (here
    # the rendering host has no py-spy at all). A result written before it was recorded
    # (null) gets no hint: nothing is known of the host that ran it.
    from cadence.lab.report import summary

    monkeypatch.setenv("PATH", "")
    result = threads_result(
        [{"pid": 7, "python": True, "threads": 2, "cpu_pct": 50.0}], [], py_spy=recorded
    )
    assert not any("py-spy" in line for line in summary.thread_lines(result.server_threads))


def test_the_stack_sampler_records_whether_py_spy_is_installed() -> None:
    from cadence.lab.measure.stacks import StackSampler, py_spy

    assert StackSampler([]).installed == (py_spy() is not None)


def test_requests_failing_gives_way_when_every_failure_was_a_refused_stream() -> None:
    refused = "Stream removed (RST_STREAM (Received RST_STREAM with error code 7))"
    only_refused = findings(result(4, errors={"UNAVAILABLE": (4, refused)}))
    assert "server_stream_limit" in only_refused and "requests_failing" not in only_refused
    mixed = findings(
        result(4, errors={"UNAVAILABLE": (4, refused), "INTERNAL": (4, "handler raised")})
    )
    assert {"server_stream_limit", "requests_failing"} <= set(mixed)


WORKER_COMMAND = (
    '/venv/bin/python -m cadence.worker {"index":0,"device":"%s","input_address":"ipc:///tmp/in"'
)


def cadence_threads(worker: dict, front: dict, device: str, **fields) -> BenchResult:
    """A cadence server's two processes (pid 10 its front, pid 11 its worker 0 on `device`)."""
    found = threads_result(
        [
            dict(front, pid=10, command="/venv/bin/python -m cadence.cli serve --port 1"),
            dict(worker, pid=11, command=WORKER_COMMAND % device),
        ],
        [],
        **fields,
    )
    found.system.processes = {"front": ProcessCpu(pid=10), "worker0": ProcessCpu(pid=11)}
    return found


STEPPING = {"python": True, "threads": 6, "cpu_pct": 98.0, "busiest_thread": "python"}
STEPPING["busiest_thread_cpu_pct"] = 97.0
IDLE_FRONT = dict(STEPPING, cpu_pct=12.0, busiest_thread_cpu_pct=9.0)


def test_a_cpu_engines_worker_filling_its_core_is_information_not_an_alarm() -> None:
    """A CPU engine's worker steps without pause while it has sequences: its full core is
    the engine's nature. Said, with the advice of the engine's step, as information; a worker
    that drives a card and fills a core is an alarm (the host side of its step holds the
    card)."""
    [found] = diagnose(cadence_threads(STEPPING, IDLE_FRONT, "cpu"))
    assert found.rule == "server_one_core_bound" and found.severity == "information"
    assert found.evidence["process"] == "worker0" and found.evidence["device"] == "cpu"
    assert "on the CPU" in found.finding and "--devices" in found.look_at
    [card] = diagnose(cadence_threads(STEPPING, IDLE_FRONT, "cuda:0"))
    assert card.severity == "alarm" and card.evidence["device"] == "cuda:0"
    # The front's event loop at a full core is an alarm whatever its workers run on.
    [front] = diagnose(cadence_threads(IDLE_FRONT, STEPPING, "cpu"))
    assert front.evidence["process"] == "front" and front.severity == "alarm"


def contended(result: BenchResult, wall_s: float = 2.0) -> BenchResult:
    """`result` on a 2-core host other work filled during its run."""
    result.wall_s = wall_s
    ticks = [0.1 * i for i in range(1, int(wall_s * 10) + 4)]
    result.system.host = HostCpu(
        cpus=2,
        samples=[(t, 195.0, 2.0) for t in ticks],
        wakeups=Distribution(count=500, p50=0.1, p90=0.5, p99=2.0, max=6.0),
    )
    return result


def test_a_thread_starved_on_a_contended_host_gives_way_to_the_host() -> None:
    """A front's loop that ran 20% of a core and waited 64% more for one, on a host other work
    filled: what it asked for is the host's doing, not a core of its own load. A loop that
    ran more than it waited is still named beside the host."""
    starved = dict(STEPPING, cpu_pct=21.0, busiest_thread_cpu_pct=20.0)
    starved["busiest_thread_wait_pct"] = 64.0
    quiet = cadence_threads(IDLE_FRONT, starved, "cpu", cpus=2)
    assert "server_one_core_bound" in findings(quiet)  # nothing else explains it
    assert set(findings(contended(quiet))) == {"host_contended"}
    running = dict(starved, cpu_pct=60.0, busiest_thread_cpu_pct=60.0, busiest_thread_wait_pct=30.0)
    busy = findings(contended(cadence_threads(IDLE_FRONT, running, "cpu", cpus=2)))
    assert {"host_contended", "server_one_core_bound"} <= set(busy)
