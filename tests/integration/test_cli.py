"""The `cadence` command line as a user meets it: version, help, mistakes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

from cadence.cli import build_parser
from tests.integration.conftest import serve_refused

COMMANDS = ("serve", "generate", "demo", "bench", "sweep", "capacity", "report")


def _cadence(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cadence.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


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
    listed = [
        line.split()[0]
        for line in lines[
            lines.index(next(line for line in lines if line.startswith("commands"))) + 1 :
        ]
        if line.startswith("  ")
    ]
    assert tuple(listed[: len(COMMANDS)]) == COMMANDS
    assert set(_commands()) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_that_shows_its_default(command) -> None:
    parser = _commands()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        assert action.help, f"cadence {command} {action.option_strings or action.dest}: no help"
        if (
            action.option_strings
            and not action.required
            and not isinstance(action, argparse._HelpAction)
        ):
            shown = formatter._get_help_string(action)
            assert "default" in shown, f"cadence {command} {action.option_strings}: {shown}"
    shown = _cadence(command, "--help").stdout
    assert shown.startswith(f"usage: cadence {command}") and "(default: " in shown


def test_a_mistyped_flag_prints_its_command_usage_and_one_error_line() -> None:
    done = _cadence("bench", "--target", "127.0.0.1:1", "--concurency", "4")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: cadence bench ")
    assert done.stderr.strip().splitlines()[-1] == (
        "cadence bench: error: unrecognized arguments: --concurency 4"
    )


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--worker-timeout", "-1"], {}, "worker_timeout_s must be positive (got -1)"),
        (["--port", "70000"], {}, "port must be 0 to 65535 (got 70000)"),
        (["--http-port", "-1"], {}, "http_port must be 0 to 65535 (got -1)"),
        (["--drain-timeout", "nan"], {}, "drain_timeout_s must be a finite number (got nan)"),
        (["--grace", "inf"], {}, "drain_timeout_s must be a finite number (got inf)"),
        (["--stall-timeout", "-2"], {}, "stall_timeout_s must be positive (got -2)"),
        (["--step-ms", "nan"], {}, "step_ms must be a finite number (got nan)"),
        (
            [],
            {"CADENCE_DRAIN_TIMOUT": "30"},
            "$CADENCE_DRAIN_TIMOUT names no flag (did you mean $CADENCE_DRAIN_TIMEOUT?)",
        ),
    ],
)
def test_a_setting_that_would_start_a_broken_server_is_refused_in_one_line(args, env, said) -> None:
    out = serve_refused("--devices", "cpu:1", "--log-level", "WARNING", *args, env=env)
    code, stderr = out.returncode, out.stderr
    assert code != 0, f"cadence serve {args} {env} started"
    assert stderr.strip().splitlines() == [
        f"cadence serve: {said}"
    ] or stderr.strip().splitlines() == [f"cadence serve: error: {said}"], stderr


@pytest.mark.parametrize(
    ("command", "section", "shown", "not_shown"),
    [
        ("bench", "load", "--concurrency", "--protocol"),
        ("sweep", "servers", "--server-cmd", "--concurrency"),
        ("capacity", "measurement", "--slo", "--max-tokens"),
        ("serve", "synthetic", "--step-ms", "--max-batch"),
        ("bench", "trace-speed", "--trace-speed", "--concurrency"),  # a flag, by its name
    ],
)
def test_help_shows_one_section_when_asked_for_it(command, section, shown, not_shown) -> None:
    """`--help=SECTION`, as vLLM's `--help=<group>`: the flags of that section of the help
    (or, when no section is named so, the flags whose names hold it), and nothing else."""
    done = _cadence(command, f"--help={section}")
    assert done.returncode == 0, done.stderr
    flags = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  --")]
    assert shown in flags and not_shown not in flags


def test_help_of_a_section_that_is_not_there_names_the_sections() -> None:
    done = _cadence("bench", "--help=nonesuch")
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.strip() == (
        "cadence bench: error: --help=nonesuch: no section or flag of that name; the sections: "
        "options, protocol, grpc, security, load, requests, replay, sessions, clients, "
        "measurement"
    )
    full = _cadence("bench", "--help").stdout
    for heading in ("load (", "requests (", "measurement (", "protocol ("):
        assert f"\n{heading}" in full
