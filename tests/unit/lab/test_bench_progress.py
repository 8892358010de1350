"""`cadence bench`'s progress bar: when it is shown, and what it shows, without a terminal."""

from __future__ import annotations

import io
import multiprocessing as mp
import time

from rich.console import Console

from cadence.cli import build_parser
from cadence.lab.load.processes import RequestCounter
from cadence.lab.load.progress import BenchProgress, progress_wanted


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _counter(per_process: list[int], started: bool = True) -> RequestCounter:
    counter = RequestCounter()
    context = mp.get_context("spawn")
    for n in per_process:
        counter.slot(context).value = n  # what each load process adds, one per request
    counter.started_ns = time.monotonic_ns() if started else None
    return counter


def _bar(progress: BenchProgress) -> tuple[float, str]:
    progress.poll()
    [task] = progress.tasks
    return task.completed, task.fields["status"]


def test_a_bar_only_on_a_terminal_and_never_with_no_progress() -> None:
    assert progress_wanted(False, _Terminal())
    assert not progress_wanted(True, _Terminal())
    assert not progress_wanted(False, io.StringIO())  # a file or a pipe: no bar
    args = build_parser().parse_args(["bench", "--target", "h:1", "--no-progress"])
    assert args.no_progress
    assert not build_parser().parse_args(["bench", "--target", "h:1"]).no_progress


def test_the_counter_sums_every_process_slot() -> None:
    assert _counter([3, 4, 0]).completed == 7
    assert RequestCounter().completed == 0


def test_the_bar_counts_requests_out_of_the_total() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    bar = BenchProgress(_counter([5, 2]), requests=10, duration_s=None, console=console)
    assert _bar(bar) == (7, "7/10 requests")
    assert bar.tasks[0].total == 10


def test_the_bar_waits_for_the_agreed_start_then_shows_time_out_of_the_duration() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    counter = _counter([1], started=False)
    bar = BenchProgress(counter, requests=None, duration_s=30.0, console=console)
    assert _bar(bar) == (0, "connecting")
    counter.started_ns = time.monotonic_ns() - 2_000_000_000
    completed, status = _bar(bar)
    assert 2.0 <= completed < 30.0 and status.endswith("/30 s, 1 requests")
    counter.started_ns = time.monotonic_ns() - 31_000_000_000  # past the duration
    completed, status = _bar(bar)
    assert completed == 30.0 and status == "30/30 s, 1 requests, finishing"


def test_the_bar_draws_on_its_console_and_is_removed_at_the_end() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with BenchProgress(_counter([4]), requests=4, duration_s=None, console=console):
        pass
    assert "4/4 requests" in out.getvalue()  # drawn once more as it stops, then cleared
