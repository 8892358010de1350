"""A server that dies in the middle of a bench: the requests after it fail, and the diagnosis
and the summary say so (they once said "no rule fired")."""

from __future__ import annotations

import threading
import time

from cadence.lab.analysis import diagnosis as dx
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.load.processes import RequestCounter
from cadence.lab.report.summary import print_summary
from tests.integration.conftest import RunningServer, start_server


def _kill_after(server: RunningServer, counter: RequestCounter, finished: int) -> threading.Thread:
    """Kill the server once `finished` requests have ended (polls the shared counter)."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while counter.completed < finished and time.monotonic() < deadline:
            time.sleep(0.005)
        server.stop()  # the front and its workers go; new calls find nothing

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_server_killed_mid_run_is_named_by_requests_failing(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at the terminal's width
    workload = Workload(requests=300, concurrency=4, shape=RequestShape(max_tokens=(4, 4)))
    counter = RequestCounter()
    with start_server("--step-ms", "5") as server:
        killer = _kill_after(server, counter, finished=12)
        result = run_bench(server.target, workload, counter=counter)
        killer.join()
    assert 12 <= result.requests_ok < result.requests == 300
    (finding,) = [f for f in result.diagnosis if f.rule == dx.RULE_REQUESTS_FAILING]
    assert finding.evidence["requests_failed"] == 300 - result.requests_ok
    assert finding.evidence["error_rate"] > 0.5
    assert "UNAVAILABLE" in finding.finding
    print_summary(result)
    out = capsys.readouterr().out
    assert "diagnosis requests_failing:" in out
    assert "no rule fired" not in out
