"""The false-alarm matrix's fast part (`benchmarks/false_alarms.py --quick`, docs/lab.md "False
alarms on healthy servers"): healthy cadence servers, 1 and 2 synthetic workers with 5 ms
steps, over gRPC and SSE, three runs each. A rule that fires in more than one run of the same
configuration, or a verdict other than healthy in more than one, is a false alarm that
repeats, and fails the test. Runs where the lab found the host filled by other work
(`host_contended`) are left out of the count, as tests/integration/host_load.py leaves them:
there another job's delays are real."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.script_import import import_script

pytestmark = [pytest.mark.alone, pytest.mark.slow]

_SCRIPT = Path(__file__).parents[2] / "benchmarks" / "false_alarms.py"
RUNS = 3


def _matrix():
    return import_script(_SCRIPT, "cadence_false_alarms")


def test_healthy_servers_raise_no_false_alarm_twice(tmp_path) -> None:
    result = _matrix().main(
        ["--quick", "--runs", str(RUNS), "--in-process", "--out", str(tmp_path / "fa.json")]
    )
    records = result["records"]
    assert not result["skipped"]
    assert len(records) == 2 * 2 * RUNS  # two servers, two protocols
    assert [r for r in records if r["verdict"] == "error"] == []
    repeated = result["summary"]["repeated_false_alarms"]
    assert repeated == {}, {
        cell: [
            (r["run"], r["verdict"], r.get("findings"), r.get("verdict_line"))
            for r in records
            if " / ".join((r["server"], r["protocol"], r["length"], r["host"])) == cell
        ]
        for cell in repeated
    }
