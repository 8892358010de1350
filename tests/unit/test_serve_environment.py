"""`cadence serve` reads each flag from CADENCE_<FLAG> (a container's settings), the command
line winning, and words a bad value as the command line's error would, naming the variable."""

from __future__ import annotations

import pytest

from cadence.cli import _server_config, build_parser
from cadence.config import PREFIX_CACHING_BY_DEFAULT
from tests.unit.lab.test_lab_flags import subcommand


def _serve(monkeypatch, env: dict[str, str], argv: list[str] = ()):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return _server_config(build_parser().parse_args(["serve", *argv]))


def test_every_kind_of_flag_comes_from_the_environment(monkeypatch) -> None:
    config = _serve(
        monkeypatch,
        {
            "CADENCE_PORT": "5",
            "CADENCE_NO_RESTART": "true",
            "CADENCE_DRAIN_TIMEOUT": "7.5",
            "CADENCE_OVERFLOW": "abort",
            "CADENCE_STEP_MS_BY_WORKER": "1,2",
            "CADENCE_DEVICES": "cpu:2",
        },
    )
    assert (
        config.port,
        config.restart_workers,
        config.drain_timeout_s,
        config.overflow,
        config.engine.step_ms_by_worker,
    ) == (5, False, 7.5, "abort", (1.0, 2.0))


def test_the_command_line_wins_and_a_false_switch_is_not_given(monkeypatch) -> None:
    config = _serve(
        monkeypatch,
        {"CADENCE_PORT": "5", "CADENCE_DRAIN_TIMEOUT": "7", "CADENCE_NO_RESTART": "false"},
        ["--port", "9", "--grace", "3"],
    )
    assert (config.port, config.drain_timeout_s, config.restart_workers) == (9, 3.0, True)


def test_unset_variables_leave_the_defaults(monkeypatch) -> None:
    assert _serve(monkeypatch, {}).port == 50051


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("CADENCE_PORT", "abc", "$CADENCE_PORT: invalid int value: 'abc'"),
        ("CADENCE_OVERFLOW", "x", "$CADENCE_OVERFLOW: invalid choice: 'x'"),
        ("CADENCE_NO_RESTART", "maybe", "$CADENCE_NO_RESTART: expected true or false"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(
    monkeypatch, capsys, name, value, said
) -> None:
    with pytest.raises(SystemExit):
        _serve(monkeypatch, {name: value})
    assert said in capsys.readouterr().err


def test_other_commands_do_not_read_it(monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_TARGET", "elsewhere:1")
    assert build_parser().parse_args(["generate", "hi"]).target == "127.0.0.1:50051"


def test_a_misspelt_variable_is_refused_naming_the_one_it_may_mean(monkeypatch, capsys) -> None:
    """CADENCE_DRAIN_TIMOUT=30 was ignored: the server drained in the default 5 s."""
    with pytest.raises(SystemExit) as exited:
        _serve(monkeypatch, {"CADENCE_DRAIN_TIMOUT": "30"})
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        (
            "cadence serve: error: $CADENCE_DRAIN_TIMOUT names no flag (did you mean "
            "$CADENCE_DRAIN_TIMEOUT?)"
        )
    ]


def test_an_unknown_variable_like_no_flag_is_warned_of_in_one_line(monkeypatch, capsys) -> None:
    assert _serve(monkeypatch, {"CADENCE_SOMETHING_ELSE": "1"}).port == 50051
    assert capsys.readouterr().err.strip().splitlines() == [
        "cadence serve: warning: $CADENCE_SOMETHING_ELSE names no flag; it is ignored"
    ]


def test_the_variables_cadence_reads_for_itself_are_not_taken_for_misspelt_flags(
    monkeypatch, capsys
) -> None:
    """Every CADENCE_ name in the sources and the tests is a flag's or in NOT_FLAGS, so that
    the check above never refuses what cadence itself sets (Envoy's front, the workers)."""
    import re
    from pathlib import Path

    from cadence.cli import NOT_FLAGS

    root = Path(__file__).parents[2]
    named = {
        name
        for folder in ("src", "tests")
        for path in (root / folder).rglob("*.py")
        for name in re.findall(r"[\"'](CADENCE_[A-Z0-9_]+)", path.read_text())
    }
    serve = subcommand("serve")
    flags = {serve.env_name(a) for a in serve._actions if a.option_strings and a.dest != "help"}
    invented_here = {"CADENCE_DRAIN_TIMOUT", "CADENCE_SOMETHING_ELSE", "CADENCE_TARGET"}
    assert named - flags - invented_here <= NOT_FLAGS
    _serve(monkeypatch, dict.fromkeys(NOT_FLAGS, "1"))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("env", "argv", "on"),
    [
        ({}, [], "torch" in PREFIX_CACHING_BY_DEFAULT),  # not given
        ({"CADENCE_PREFIX_CACHING": "false"}, [], False),  # false turns it off
        ({"CADENCE_PREFIX_CACHING": "false"}, ["--prefix-caching"], True),
        ({"CADENCE_PREFIX_CACHING": "true"}, ["--no-prefix-caching"], False),
    ],
)
def test_a_switch_both_ways_is_set_by_true_and_by_false(monkeypatch, env, argv, on) -> None:
    config = _serve(monkeypatch, env, ["--engine", "torch", "--model", "tiny", *argv])
    assert config.engine.prefix_caching is on
