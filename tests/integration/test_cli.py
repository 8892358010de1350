"""The `cadence` command line as a user meets it: version, help, mistakes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

from cadence.cli import build_parser

COMMANDS = ("serve", "generate", "demo", "bench", "sweep", "capacity", "report")


def _cadence(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cadence.cli", *args], check=False,
                          capture_output=True, text=True, timeout=60)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_version_is_the_package_version() -> None:
    done = _cadence("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"cadence {version('cadence')}"


def test_the_description_lists_every_command_on_one_line() -> None:
    done = _cadence("--help")
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    listed = [line.split()[0] for line in lines[lines.index(next(
        line for line in lines if line.startswith("commands"))) + 1:] if line.startswith("  ")]
    assert tuple(listed[:len(COMMANDS)]) == COMMANDS
    assert set(_commands()) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_that_shows_its_default(command) -> None:
    parser = _commands()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        assert action.help, f"cadence {command} {action.option_strings or action.dest}: no help"
        if action.option_strings and not action.required \
                and not isinstance(action, argparse._HelpAction):
            shown = formatter._get_help_string(action)
            assert "default" in shown, f"cadence {command} {action.option_strings}: {shown}"
    shown = _cadence(command, "--help").stdout
    assert shown.startswith(f"usage: cadence {command}") and "(default: " in shown


def test_a_mistyped_flag_prints_its_command_usage_and_one_error_line() -> None:
    done = _cadence("bench", "--target", "127.0.0.1:1", "--concurency", "4")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: cadence bench ")
    assert done.stderr.strip().splitlines()[-1] == (
        "cadence bench: error: unrecognized arguments: --concurency 4")
