"""The tests start `cadence serve` one way: tests/integration/conftest.py's `start_server` (or
its fixtures), so that CADENCE_TEST_SERVE_ARGS, the health wait and the check that no worker
outlives its server hold for every test."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

_OTHER_WAYS = re.compile(
    r"\bServerProcess\(|Popen\((?!  # own start)\s*\[sys\.executable, \"-m\", "
    r"\"cadence\.cli\", \"serve\""
)
"""`# own start` after `Popen(` marks a test that needs what start_server does not do."""


def test_no_test_starts_a_server_another_way() -> None:
    found = [
        f"{path.relative_to(TESTS)}:{text[: match.start()].count(chr(10)) + 1}"
        for path in sorted(TESTS.rglob("*.py"))
        if "node_modules" not in path.parts and path.name != "test_one_server_start.py"
        for text in [path.read_text()]
        for match in _OTHER_WAYS.finditer(text)
    ]
    assert not found, f"start servers with conftest's start_server, not as in {found}"
