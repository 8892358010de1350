"""A short run of the soak test (benchmarks/soak.py): mixed good and bad traffic with a worker
killed midway, then the loss and leak checks. The full run lasts minutes; this one seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_import import import_script

_SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _load_soak():
    return import_script(_SOAK, "cadence_soak")


@pytest.mark.slow
def test_short_soak_loses_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    code = _load_soak().main(["--duration", "6", "--rate", "30", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0, (result["checks"], result["problems"][:5])
    assert result["tokens_lost"] == 0
    assert result["faults"]["worker_kills"] == 1
    # Every kind of request was sent, so every path was exercised.
    assert set(result["requests_by_kind"]) == {
        "normal",
        "slow",
        "cancel_before",
        "cancel_mid",
        "cancel_after_last",
        "deadline",
        "malformed",
        "over_limit",
    }
    assert result["server_exit_status"] == 0
