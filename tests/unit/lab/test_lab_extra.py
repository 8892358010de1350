"""Plotting is the `lab` extra: without it, `cadence report` says which extra to install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_WITHOUT_MATPLOTLIB = """
import sys
from importlib.abc import MetaPathFinder

class Hide(MetaPathFinder):  # as if matplotlib were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Hide())
from cadence.cli import main
main(sys.argv[1:])
"""


def test_report_without_the_lab_extra_names_it(tmp_path: Path) -> None:
    result = tmp_path / "run.json"
    result.write_text(json.dumps({"summary": {}}))
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_MATPLOTLIB, "report", str(result)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0
    assert out.stderr.strip() == (
        "cadence report: the report's plots need matplotlib, which is not installed; install "
        "it with: pip install 'cadence[lab]'"
    )


def test_the_server_does_not_need_matplotlib() -> None:
    code = _WITHOUT_MATPLOTLIB.replace(
        "from cadence.cli import main\nmain(sys.argv[1:])\n",
        (
            "import cadence.cli, cadence.lifecycle.server, cadence.client\n"
            "assert 'matplotlib' not in sys.modules\n"
        ),
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
