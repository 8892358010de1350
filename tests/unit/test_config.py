"""parse_devices: the --devices flag."""

from __future__ import annotations

import msgspec
import pytest

from cadence import config
from cadence.config import EngineConfig, ServerConfig, parse_devices


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu", ["cpu"]),
        ("cpu:1", ["cpu"]),
        ("cpu:3", ["cpu", "cpu", "cpu"]),
        ("  cpu:2 ", ["cpu", "cpu"]),
        ("cuda", ["cuda:0"]),
        ("cuda:0", ["cuda:0"]),
        ("cuda:0,1", ["cuda:0", "cuda:1"]),
        ("cuda:3,1", ["cuda:3", "cuda:1"]),
        ("cuda:0, 2", ["cuda:0", "cuda:2"]),
    ],
)
def test_valid_devices(text: str, expected: list[str]):
    assert parse_devices(text) == expected


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("cpu:0", "cpu:N"),
        ("cpu:-2", "cpu:N"),
        ("cpu:x", "cpu:N"),
        ("cpu:1.5", "cpu:N"),
        ("cuda:0,0", "distinct"),
        ("cuda:-1", "cuda:I,J"),
        ("cuda:,", "cuda:I,J"),
        ("cuda:a", "cuda:I,J"),
        ("cuda:0,b", "cuda:I,J"),
        ("gpu:0", "cpu:N, cuda:I,J,... or auto"),
        ("", "cpu:N, cuda:I,J,... or auto"),
        ("tpu", "cpu:N, cuda:I,J,... or auto"),
    ],
)
def test_invalid_devices_raise_helpful_value_error(text: str, hint: str):
    with pytest.raises(ValueError) as info:
        parse_devices(text)
    message = str(info.value)
    assert "--devices" in message
    assert hint in message
    assert repr(text.strip()) in message  # says what was given


def test_auto_uses_every_visible_card(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(config, "cuda_device_count", lambda: 2)
    assert parse_devices("auto") == ["cuda:0", "cuda:1"]


def test_auto_falls_back_to_one_cpu_worker(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(config, "cuda_device_count", lambda: 0)
    assert parse_devices("auto") == ["cpu"]


def test_server_config_defaults():
    c = ServerConfig()
    assert c.devices == ["cpu"]
    assert c.overflow == "merge"
    assert c.queue_capacity >= 1 and c.max_concurrent >= 1


@pytest.mark.parametrize(
    ("fields", "hint"),
    [
        ({"launcher": "ray"}, "--launcher ray needs --transport tcp"),
        ({"launcher": "ray", "transport": "tcp", "fronts": 2}, "runs one front"),
        ({"launcher": "slurm"}, "launcher must be 'local' or 'ray'"),
        ({"ray_address": "10.0.0.1:6379"}, "need --launcher ray"),
        ({"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 0.5}, "below heartbeat_timeout_s"),
    ],
)
def test_placement_options_are_checked(fields: dict, hint: str):
    with pytest.raises(ValueError, match=hint):
        ServerConfig(**fields)


def test_ray_launcher_config_is_accepted():
    config = ServerConfig(launcher="ray", transport="tcp", ray_address="auto", dist_ifname="eth1")
    assert config.launcher == "ray" and config.heartbeat_timeout_s == 5.0


def test_cli_defaults_are_the_configs_own() -> None:
    """`cadence serve` without flags builds exactly the default ServerConfig: the CLI reads its
    defaults from the config classes, so there is no second copy to drift."""
    from cadence.cli import _server_config, build_parser

    assert _server_config(build_parser().parse_args(["serve"])) == ServerConfig()


@pytest.mark.parametrize(
    ("argv", "on"),
    [
        # Not given: on for the engines of PREFIX_CACHING_BY_DEFAULT (none while its cost is
        # above 2%: docs/models.md, "Prefix caching").
        (["--engine", "torch", "--model", "tiny"], "torch" in config.PREFIX_CACHING_BY_DEFAULT),
        (["--engine", "torch", "--model", "tiny", "--no-prefix-caching"], False),
        (["--engine", "torch", "--model", "tiny", "--prefix-caching"], True),  # the old flag
        ([], False),  # synthetic: its model of the torch engine's cache, when asked for
        (["--prefix-caching"], True),
        (["--engine", "mod:Model"], False),  # a model class: no cache cadence knows of
        (["--app", "json:dumps"], False),
        (["--engine", "transformers", "--model", "some/folder"], False),
    ],
)
def test_prefix_caching_is_on_where_the_engine_has_a_prefix_cache(argv: list, on: bool) -> None:
    from cadence.cli import _server_config, build_parser

    config = _server_config(build_parser().parse_args(["serve", *argv]))
    assert config.engine.prefix_caching is on
    assert config.engine == msgspec.json.decode(
        msgspec.json.encode(config.engine), type=EngineConfig
    )  # as a worker receives it


def test_prefix_caching_asked_for_an_app_is_refused_and_python_turns_it_off() -> None:
    from cadence.serving import configure

    with pytest.raises(ValueError, match="--prefix-caching and --preempt need a step engine"):
        ServerConfig(engine=EngineConfig(name="app", app="json:dumps", prefix_caching=True))
    assert EngineConfig(name="torch").prefix_caching is (
        "torch" in config.PREFIX_CACHING_BY_DEFAULT
    )
    served, _ = configure("json:dumps", {})
    assert served.engine.prefix_caching is False
    assert EngineConfig(name="torch", prefix_caching=False).prefix_caching is False


def test_counts_read_as_plain_english() -> None:
    with pytest.raises(ValueError, match=r"1 worker, got 2 values"):
        ServerConfig(engine=EngineConfig(step_ms_by_worker=(1.0, 2.0)))
    with pytest.raises(ValueError, match=r"2 workers, got 1 value$"):
        ServerConfig(devices=["cpu", "cpu"], engine=EngineConfig(step_ms_by_worker=(1.0,)))


@pytest.mark.parametrize(
    ("cores", "devices", "threads"),
    [
        (2, ["cpu"], 1),  # one core left to the front
        (16, ["cpu"], 15),
        (16, ["cpu", "cpu"], 7),
        (2, ["cpu", "cpu"], 1),  # no core to leave: one thread each
        (1, ["cpu"], 1),
        (4, ["cuda:0", "cuda:1"], 0),  # no CPU rank: torch's own default
    ],
)
def test_cpu_ranks_leave_the_front_a_core_where_the_host_has_one_to_spare(
    monkeypatch: pytest.MonkeyPatch, cores: int, devices: list[str], threads: int
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert config.cpu_threads_per_rank(devices) == threads
