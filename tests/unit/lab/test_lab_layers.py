"""The lab's stages import one way: load -> measure -> analysis -> report, over the shared
records below them, with the commands (bench, sweep, capacity) on top and their CLIs above those.

Each of the lab's modules' imports is read from its source (ast: imports inside functions and
under TYPE_CHECKING count too, since a lazy import back up is still a tie) and checked against
what its layer may import. Data flows from one stage to the next through the shared records
(`records.py`, `results.py`), not through one stage importing another: load and measure run
side by side during a run, analysis reads what they recorded, and the report renders what the
analysis made."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src"
LAB = SRC / "cadence" / "lab"

SHARED = "shared"
CLI = "cli"
COMMAND = "command"

_SHARED_MODULES = {
    "cadence.lab",
    "cadence.lab.records",
    "cadence.lab.results",
    "cadence.lab.percentile",
    "cadence.lab.scraped_keys",
    "cadence.lab.output_paths",
}
"""Below every stage: the records a stage writes and the next one reads, and what they share."""

_CLI_MODULES = {
    "cadence.lab.bench_cli",
    "cadence.lab.sweep_cli",
    "cadence.lab.capacity_cli",
    "cadence.lab.report_cli",
}

MAY_IMPORT = {
    SHARED: {SHARED},
    "load": {SHARED, "load"},
    "measure": {SHARED, "measure"},
    "analysis": {SHARED, "analysis"},
    "report": {SHARED, "analysis", "report"},
    "servers": {SHARED, "load", "measure", "servers"},
    COMMAND: {SHARED, "load", "measure", "analysis", "report", "servers", COMMAND},
    CLI: {SHARED, "load", "measure", "analysis", "report", "servers", COMMAND, CLI},
}
"""What each layer may import from the lab. Not listed, so against the direction: analysis
from load or measure, measure from analysis, load from either, the report from measure or
from a command, and a command (the sweep library among them) from a CLI module."""


def layer(module: str) -> str:
    if module in _SHARED_MODULES:
        return SHARED
    if module in _CLI_MODULES:
        return CLI
    part = module.split(".")[2]
    return part if part in MAY_IMPORT else COMMAND


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(LAB.rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """(the lab module imported, the names imported from it, line) for each of `module`'s
    imports of the lab, wherever they are in the file."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[: len(package) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import module` imports the module; `from module import name`, a name.
            targets = [
                (f"{base}.{a.name}", []) if f"{base}.{a.name}" in MODULES else (base, [a.name])
                for a in node.names
            ]
        else:
            continue
        for target, names in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("cadence.lab") and target != module:
                found.append((target, names, node.lineno))
    return found


def against_the_direction() -> list[str]:
    wrong = []
    for module in MODULES:
        mine = layer(module)
        for target, names, line in imports(module):
            theirs = layer(target)
            if theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{module}:{line} ({mine}) imports {target} ({theirs})")
            private = [n for n in names if n.startswith("_")]
            if private:
                wrong.append(f"{module}:{line} imports {target}'s private {', '.join(private)}")
    return wrong


def test_the_lab_imports_one_way() -> None:
    wrong = against_the_direction()
    assert not wrong, "imports against the lab's direction:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("cadence.lab.records", SHARED),
        ("cadence.lab.load.plan", "load"),
        ("cadence.lab.measure.sampler", "measure"),
        ("cadence.lab.analysis.diagnosis.itl", "analysis"),
        ("cadence.lab.report.summary", "report"),
        ("cadence.lab.sweep", COMMAND),
        ("cadence.lab.sweep_cli", CLI),
    ],
)
def test_every_module_has_its_layer(module: str, expected: str) -> None:
    assert module in MODULES
    assert layer(module) == expected


def test_imports_inside_functions_count() -> None:
    # bench_cli imports the load generator lazily (inside functions): those are seen too.
    lazy = {
        target
        for target, _, line in imports("cadence.lab.bench_cli")
        if target.startswith("cadence.lab.load.")
    }
    assert "cadence.lab.load.plan" in lazy
