"""A short run of the soak test (benchmarks/soak.py): mixed good and bad traffic with a worker
killed midway, then the loss and leak checks. The full run lasts minutes; this one seconds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _load_soak():
    spec = importlib.util.spec_from_file_location("cadence_soak", _SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


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
