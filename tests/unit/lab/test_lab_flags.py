"""The lab's flags are contracts: `cadence bench`, `sweep` and `capacity` keep every flag, its
destination, default, constant, choices, nargs and whether it is required, exactly as
tests/data/lab_flags.json holds them (a flag may be added: then add it there too, with
`python tests/unit/lab/test_lab_flags.py`, and say why in the commit). A refactor of how the
options are declared changes none of these."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cadence.cli import build_parser

CONTRACT = Path(__file__).resolve().parents[2] / "data" / "lab_flags.json"
COMMANDS = ("bench", "sweep", "capacity")


def subcommand(name: str) -> argparse.ArgumentParser:
    """`cadence NAME`'s parser."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _plain(value):
    """A default or constant as JSON holds it (a function or type by its name)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return repr(value)


def flags(name: str) -> dict[str, dict]:
    """Each flag of `cadence NAME` by its first option string."""
    parser = subcommand(name)
    exclusive = {
        id(a): sorted(b.option_strings[0] for b in g._group_actions)
        for g in parser._mutually_exclusive_groups
        for a in g._group_actions
    }
    return {
        action.option_strings[0]: {
            "flags": sorted(action.option_strings),
            "dest": action.dest,
            "default": _plain(action.default),
            "const": _plain(action.const),
            "choices": _plain(list(action.choices)) if action.choices else None,
            "nargs": _plain(action.nargs),
            "required": action.required,
            "exclusive_with": exclusive.get(id(action), []),
        }
        for action in parser._actions
        if action.option_strings
    }


@pytest.mark.parametrize("name", COMMANDS)
def test_the_lab_commands_keep_their_flags_and_defaults(name: str) -> None:
    held = json.loads(CONTRACT.read_text())[name]
    now = flags(name)
    assert sorted(now) == sorted(held), "flags added or removed"
    for flag, declared in held.items():
        assert now[flag] == declared, flag


if __name__ == "__main__":  # one flag a line, so that a change reads as one line's
    CONTRACT.write_text(
        "{\n"
        + ",\n".join(
            f"{json.dumps(name)}: {{\n"
            + ",\n".join(
                f"  {json.dumps(flag)}: {json.dumps(spec, sort_keys=True)}"
                for flag, spec in sorted(flags(name).items())
            )
            + "\n}"
            for name in COMMANDS
        )
        + "\n}\n"
    )
