"""Each `cadence serve` option is declared once, on its config field: the command line's flags
and `cadence.serve()`'s keywords are both read from those declarations."""

from __future__ import annotations

import argparse
import re
import typing

import pytest

from cadence.cli import _server_config, build_parser
from cadence.config import EngineConfig, ServerConfig, serve_options
from cadence.serving import configure

_APP = "json:dumps"
"""A function that a worker could import; configure() never calls it."""


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _flags() -> dict[str, argparse.Action]:
    return {a.dest: a for a in _serve_parser()._actions if a.option_strings and a.dest != "help"}


def test_the_command_line_and_the_python_api_take_the_same_options() -> None:
    declared = {o.name for o in serve_options()}
    assert set(_flags()) - {"log_level"} == declared
    # The app argument of cadence.serve() gives what --engine and --app give.
    by_app = {o.name for o in serve_options() if not o.option.python}
    assert by_app == {"name", "app"}
    for option in serve_options():
        if option.name in by_app:
            with pytest.raises(TypeError, match="given by the app argument"):
                configure(_APP, {option.name: option.default})
        else:
            configure(_APP, {option.name: option.default})  # accepted, its default valid
    with pytest.raises(TypeError, match="log_level"):
        configure(_APP, {"log_level": "INFO"})


def test_each_flag_is_its_fields_type_default_and_choices() -> None:
    flags = _flags()
    for option in serve_options():
        flag = flags[option.name]
        assert flag.option_strings == list(option.flags)
        assert flag.default is argparse.SUPPRESS  # the config's default applies
        assert flag.help and "default" in flag.help, option.name
        if option.choices is not None:
            assert tuple(flag.choices) == option.choices
    assert flags["drain_timeout_s"].option_strings == ["--drain-timeout", "--grace"]


def test_no_flags_build_the_default_config_and_flags_set_their_fields() -> None:
    parser = build_parser()
    assert _server_config(parser.parse_args(["serve"])) == ServerConfig()
    config = _server_config(
        parser.parse_args(
            [
                "serve",
                "--devices",
                "cpu:4",
                "--tp",
                "2",
                "--stall-timeout",
                "3",
                "--no-restart",
                "--worker-timeout",
                "0",
                "--grace",
                "1.5",
                "--overflow",
                "block",
                "--launcher",
                "ray",
                "--step-ms-by-worker",
                "10,20",
                "--engine",
                "mod:Model",
                "--worker-max-failed-steps",
                "0",
            ]
        )
    )
    assert config.devices == ["cpu,cpu", "cpu,cpu"] and config.stall_timeout_s == 3.0
    assert not config.restart_workers and config.worker_timeout_s is None
    assert config.worker_max_failed_steps == 0
    assert config.drain_timeout_s == 1.5 and config.overflow == "block"
    assert config.transport == "tcp"  # implied by --launcher ray
    assert config.engine == EngineConfig(
        name="model", model_class="mod:Model", step_ms_by_worker=(10.0, 20.0)
    )


def test_the_python_api_names_an_unknown_option_and_what_it_may_have_meant() -> None:
    with pytest.raises(
        TypeError,
        match=r"unknown option 'max_concurent' \(did you mean "
        r"'max_concurrent'\?\)",
    ):
        configure(_APP, {"max_concurent": 8})
    with pytest.raises(TypeError, match=r"'stall_timeout' \(did you mean 'stall_timeout_s'"):
        configure(_APP, {"stall_timeout": 3})
    # A keyword spelt after one of the option's flags (--grace) names the option.
    with pytest.raises(TypeError, match=r"'grace_s' \(did you mean 'drain_timeout_s'\?\)"):
        configure(_APP, {"grace_s": 3})
    with pytest.raises(ValueError, match="overflow"):
        configure(_APP, {"overflow": "drop"})
    config, _ = configure(_APP, {"devices": "cpu:2", "port": 0, "max_concurrent": 8})
    assert config.devices == ["cpu", "cpu"] and config.engine.app == _APP


def test_a_constructor_checks_a_declared_choice() -> None:
    with pytest.raises(ValueError, match="overflow must be 'merge', 'block' or 'abort'"):
        ServerConfig(overflow="drop")
    with pytest.raises(
        ValueError, match="dtype must be 'auto', 'float32', 'bfloat16' or 'float16'"
    ):
        ServerConfig(engine=EngineConfig(dtype="float64"))


def test_the_sweeps_server_variables_set_serve_options_by_their_flags() -> None:
    from cadence.lab.sweep import SERVER_VARIABLES

    flags = {o.name: o.flags[0] for o in serve_options()}
    for name, flag in SERVER_VARIABLES.items():
        assert flag == flags["devices" if name == "workers" else name], name


def _numbers() -> list:
    """The options whose values are numbers (not switches)."""
    return [
        o
        for o in serve_options()
        if o.name != "tp"
        and any(kind in (int, float) for kind in (*typing.get_args(o.kind), o.kind))
        or o.name == "step_ms_by_worker"
    ]


def test_every_number_option_declares_its_bounds() -> None:
    """Checked in one place, from the declarations: a new number option says its range."""
    unbounded = {o.name for o in _numbers() if o.option.at_least is None and o.option.above is None}
    assert unbounded == {"seed"}  # any 64-bit seed


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_no_float_option_takes_nan_or_infinity(text: str) -> None:
    """NaN passes no comparison: a NaN drain timeout or step started a broken server."""
    parser = build_parser()
    floats = [
        o
        for o in _numbers()
        if float in (*typing.get_args(o.kind), o.kind) or o.name == "step_ms_by_worker"
    ]
    assert {"drain_timeout_s", "worker_timeout_s", "step_ms", "idle_connection_timeout_s"} <= {
        o.name for o in floats
    }
    for option in floats:
        with pytest.raises(ValueError, match=f"{option.name} must be a finite number"):
            _server_config(parser.parse_args(["serve", f"{option.flags[0]}={text}"]))


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--port", "70000", "port must be 0 to 65535 (got 70000)"),
        ("--port", "-1", "port must be 0 to 65535 (got -1)"),
        ("--metrics-port", "65536", "metrics_port must be 0 to 65535 (got 65536)"),
        ("--http-port", "-5", "http_port must be 0 to 65535 (got -5)"),
        ("--worker-timeout", "-1", "worker_timeout_s must be positive (got -1)"),
        ("--drain-timeout", "-1", "drain_timeout_s must not be negative (got -1)"),
        ("--idle-connection-timeout", "0", "idle_connection_timeout_s must be positive (got 0)"),
        ("--heartbeat-timeout", "-3", "heartbeat_timeout_s must be positive (got -3)"),
        ("--startup-timeout", "0", "startup_timeout_s must be positive (got 0)"),
        ("--max-batch", "0", "max_batch must be at least 1 (got 0)"),
        ("--kv-cache-tokens", "8", "kv_cache_tokens must be at least 16 (got 8)"),
        ("--jitter-ms", "-1", "jitter_ms must not be negative (got -1)"),
    ],
)
def test_a_number_outside_its_bounds_is_refused_saying_them(flag, value, said) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        _server_config(build_parser().parse_args(["serve", flag, value]))


def test_bounds_hold_for_the_python_api_too() -> None:
    with pytest.raises(ValueError, match=re.escape("port must be 0 to 65535 (got 70000)")):
        configure(_APP, {"port": 70000})
    with pytest.raises(ValueError, match="drain_timeout_s must be a finite number"):
        ServerConfig(drain_timeout_s=float("nan"))
    assert configure(_APP, {"worker_timeout_s": 0.5, "port": 0, "drain_timeout_s": 0})


def test_threads_sets_the_torch_threads_of_each_cpu_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--threads N` is what each CPU rank gives torch.set_num_threads; not given, the host's
    cores shared among the ranks (`cpu_threads_per_rank`), which the help says."""
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    parser = build_parser()

    def threads(*flags: str) -> int:
        args = ["serve", "--engine", "transformers", "--model", "m", "--devices", "cpu:2"]
        return _server_config(parser.parse_args([*args, *flags])).engine.threads

    assert threads() == 7
    assert threads("--threads", "3") == 3
    assert threads("--threads", "0") == 0  # torch's own number
    assert "cores shared among the CPU ranks" in _flags()["threads"].help
    with pytest.raises(ValueError, match=re.escape("threads must not be negative (got -1)")):
        _server_config(parser.parse_args(["serve", "--threads", "-1"]))
    config, _ = configure("json:dumps", {"threads": 2})
    assert config.engine.threads == 2
