"""How the false-alarm matrix (benchmarks/false_alarms.py) counts a run's findings: alarms
are false alarms on a healthy server, information (a light load, a CPU engine's worker filling
its core) is counted apart and never repeats as one."""

from __future__ import annotations

from pathlib import Path

from tests.script_import import import_script

_SCRIPT = Path(__file__).parents[3] / "benchmarks" / "false_alarms.py"


def _matrix():
    return import_script(_SCRIPT, "cadence_false_alarms_count")


def result(*findings: tuple[str, str]) -> dict:
    """A healthy run's result JSON with findings (rule, severity); severity "" as a result
    written before severities has it (no key)."""
    return {
        "verdict": {"state": "healthy", "line": "healthy: ...", "tails": [], "problems": []},
        "diagnosis": [
            {"rule": rule, "finding": "...", "evidence": {}, "look_at": "..."}
            | ({"severity": severity} if severity else {})
            for rule, severity in findings
        ],
        "itl_ms": {"p50": 5.0, "p99": 7.0},
        "ttft_ms": {"p99": 20.0},
        "wall_s": 2.0,
        "system": {},
    }


def test_information_is_counted_apart_from_alarms() -> None:
    matrix = _matrix()
    record = matrix.run_record(
        result(("under_capacity", "information"), ("itl_unstable_engine", "alarm"))
    )
    assert record["rules"] == ["itl_unstable_engine"]
    assert record["information"] == ["under_capacity"]
    # A result written before severities: every finding an alarm, as it was read then.
    assert matrix.run_record(result(("under_capacity", "")))["rules"] == ["under_capacity"]


def test_information_in_every_run_is_no_repeated_false_alarm() -> None:
    matrix = _matrix()
    cell = {"server": "synthetic w4 20 ms", "protocol": "grpc", "length": "short", "host": "quiet"}
    records = [
        {**cell, "run": k, **matrix.run_record(result(("under_capacity", "information")))}
        for k in range(3)
    ]
    summary = matrix.summarize(records)
    assert summary["repeated_false_alarms"] == {} and summary["rules"] == {}
    assert summary["information"] == {"under_capacity": {"quiet": {"fired": 3, "runs": 3}}}
    assert "Information (true of a healthy server, no alarm): `under_capacity` 3 / 3 quiet" in (
        matrix.markdown({"summary": summary})
    )
