"""Stream model output over gRPC from machines with several accelerator cards, and measure
where the latency goes."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
import typing

from cadence import event_loop


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default, unless the help already says what it is; an
    unset default reads "none", a switch's "off"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.required:
            return action.help
        if action.option_strings and action.default is False:
            return f"{action.help} (default: off)"
        if action.option_strings and action.default in (None, "", []):
            return f"{action.help} (default: none)"
        return super()._get_help_string(action)


NOT_FLAGS = frozenset(
    {
        "CADENCE_STARTER_PID",  # cadence.worker: set by the server for the processes it starts
        "CADENCE_ENVOY_CONFIG",
        "CADENCE_ENVOY_CONTROL",
        "CADENCE_ENVOY_FRONT",  # envoy_front:
        "CADENCE_ENVOY_PYTHON",
        "CADENCE_ENVOY_LOG_LEVEL",  # for the front that Envoy runs
        "CADENCE_TEST_SERVE_ARGS",  # the test suite's servers (tests/integration/conftest.py)
        "CADENCE_IMAGE_TEST",
        "CADENCE_IMAGE_BASE",
        "CADENCE_IMAGE_WHEELS",  # test_container.py
        "CADENCE_PODMAN_RUN_ARGS",
    }
)
"""CADENCE_ variables that cadence reads, or sets for its own processes, that are no flag of
`cadence serve`: never taken for a misspelt one (tests/unit/test_serve_environment.py holds
this list to every CADENCE_ name in the sources)."""


class _CommandParser(argparse.ArgumentParser):
    """A command's parser: its flags' defaults in its help, and a mistyped flag reported
    with this command's usage (argparse leaves it to the top level, which shows its own)."""

    def __init__(self, *, env_prefix: str = "", **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsShown)
        super().__init__(**kwargs)
        for action in self._actions:
            if action.dest == "help":
                action.help = (
                    "show this help and exit; --help=SECTION shows one section "
                    "(by the first words of its heading: --help=load), or else the "
                    "flags whose names hold SECTION"
                )
        self.env_prefix = env_prefix
        """Set: each `--flag-name` also read from $PREFIX_FLAG_NAME when the command line
        does not give it (a container's settings from its environment)."""

    def env_name(self, action: argparse.Action) -> str:
        """The environment variable of a flag: its first long name, upper case, `_` for `-`."""
        flag = next(o for o in action.option_strings if o.startswith("--"))
        return self.env_prefix + flag[2:].upper().replace("-", "_")

    def _from_environment(self, namespace: argparse.Namespace) -> argparse.Namespace:
        """The flags set in the environment, checked as the command line's are (type,
        choices), into `namespace`, where the command line's own values replace them."""
        self._check_environment_names()
        for action in self._actions:
            if not action.option_strings or action.dest == "help":
                continue
            name = self.env_name(action)
            text = os.environ.get(name)
            if text is None:
                continue
            if action.nargs == 0:  # a switch: given (true) or not (false)
                if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
                    self.error(f"${name}: expected true or false, got {text!r}")
                on = text.lower() in ("1", "true", "yes", "on")
                if isinstance(action, _OnOrOff):  # false turns it off, not leaves the default
                    value = on
                elif not on:
                    continue
                else:
                    value = action.const
            else:
                try:
                    value = self._get_value(action, text)
                    self._check_value(action, value)
                except argparse.ArgumentError as exc:
                    self.error(f"${name}: {exc.message}")
            setattr(namespace, action.dest, value)
        return namespace

    def _check_environment_names(self) -> None:
        """A variable with the prefix that names no flag is a typo the server would otherwise
        ignore, silently (CADENCE_DRAIN_TIMOUT=30: a 5 s drain): refused when it is close to a
        flag's variable, with the one it may have meant; any other is warned of, in one line."""
        known = {self.env_name(a) for a in self._actions if a.option_strings and a.dest != "help"}
        for name in sorted(os.environ):
            if not name.startswith(self.env_prefix) or name in known or name in NOT_FLAGS:
                continue
            # Compared without the prefix, which every name shares.
            meant = difflib.get_close_matches(
                name.removeprefix(self.env_prefix),
                [k.removeprefix(self.env_prefix) for k in known],
                n=1,
                cutoff=0.75,
            )
            if meant:  # one line: the usage would not help with a variable
                self.exit(
                    2,
                    f"{self.prog}: error: ${name} names no flag (did you mean "
                    f"${self.env_prefix}{meant[0]}?)\n",
                )
            print(f"{self.prog}: warning: ${name} names no flag; it is ignored", file=sys.stderr)

    def _section_help(self, wanted: str) -> typing.NoReturn:
        """`--help=SECTION`, as vLLM's `--help=<group>`: the sections whose name (`_section`)
        starts with SECTION, else the flags whose names hold it; exit 2 naming the sections
        when nothing matches."""
        key = wanted.strip().lower().replace("-", " ")
        groups = [g for g in self._action_groups if g._group_actions]
        chosen = [g for g in groups if _section(g.title).startswith(key)] if key else []
        flags = (
            [a for a in self._actions if any(key.replace(" ", "-") in o for o in a.option_strings)]
            if key
            else []
        )
        if not chosen and not flags:
            names = ", ".join(_section(g.title).replace(" ", "-") for g in groups)
            self.exit(
                2,
                f"{self.prog}: error: --help={wanted}: no section or flag of that "
                f"name; the sections: {names}\n",
            )
        formatter = self._get_formatter()
        shown = [(g.title, g._group_actions) for g in chosen] or [
            (f"flags that hold {wanted!r}", flags)
        ]
        for title, actions in shown:
            formatter.start_section(title)
            formatter.add_arguments(actions)
            formatter.end_section()
        self._print_message(formatter.format_help(), sys.stdout)
        self.exit(0)

    def parse_known_args(self, args=None, namespace=None):
        given = sys.argv[1:] if args is None else args
        wanted = next((a.removeprefix("--help=") for a in given if a.startswith("--help=")), None)
        if wanted is not None:
            self._section_help(wanted)
        if self.env_prefix:
            namespace = self._from_environment(namespace or argparse.Namespace())
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed, unknown


def _section(title: str | None) -> str:
    """A help section's name for `--help=SECTION`: its heading up to a `(` or `:`, less a
    leading "the", lower case (`the engine (what generates the tokens)`: engine)."""
    name = (title or "").split("(")[0].split(":")[0].strip().lower()
    return name.removeprefix("the ")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from cadence.config import serve_options

    p = sub.add_parser(
        "serve",
        help="run a server: the gRPC front and one worker per device",
        env_prefix="CADENCE_",
        description="Every flag can also be set in the environment: --flag-name "
        "as CADENCE_FLAG_NAME (switches: true or false); the "
        "command line wins.",
    )
    sections: dict[str, argparse._ArgumentGroup] = {}
    for option in serve_options():  # each flag as its config field declares it
        section = option.option.section
        group = (
            p
            if not section
            else sections.get(section)
            or sections.setdefault(section, p.add_argument_group(section))
        )
        group.add_argument(*option.flags, **_flag(option))
    p.add_argument(
        "--log-level",
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR: the least severe message logged",
    )
    p.set_defaults(func=_serve)


def _flag(option) -> dict:
    """argparse's arguments for `option`'s flag. Its default is left out of the namespace, so
    that only the options given reach `server_config`, as with `cadence.serve()`."""
    declared = option.option
    flag = {
        "dest": option.name,
        "default": argparse.SUPPRESS,
        "help": _help(declared.help, _shown(option)).replace("%", "%%"),
    }
    if option.both_ways:
        flag["action"] = _OnOrOff
        return flag
    if option.kind is bool:
        flag["action"] = "store_false" if option.default else "store_true"
        return flag
    if declared.parse is not None:
        flag["type"] = _typed(declared.parse)
    elif option.choices is None:
        kinds = [k for k in typing.get_args(option.kind) if k is not type(None)]
        flag["type"] = kinds[0] if kinds else option.kind
    flag["choices"] = option.choices
    flag["metavar"] = declared.metavar
    return flag


class _OnOrOff(argparse.Action):
    """`--flag` sets True, `--no-flag` False (a switch whose default depends on other options:
    config.ServeOption.both_ways)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))


def _help(text: str, default: str) -> str:
    if "{default}" in text:
        return text.replace("{default}", default)
    return text if "default" in text else f"{text} (default: {default})"


def _shown(option) -> str:
    """How `option`'s default reads in the help."""
    default = option.default
    if option.option.show is not None:
        return option.option.show(default)
    if option.kind is bool:
        return "off"
    if default in (None, "", (), []):
        return "none"
    return f"{default:g}" if isinstance(default, float) else str(default)


def _typed(parse):
    """`parse` as an argparse type: its ValueError's message becomes the usage error."""

    def typed(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    typed.__name__ = parse.__name__
    return typed


def _serve(args: argparse.Namespace) -> None:
    from cadence.lifecycle import ServingFailed, StartupError
    from cadence.lifecycle.server import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        config = _server_config(args)
    except ValueError as exc:
        sys.exit(f"cadence serve: {exc}")

    def announce(server, port: int) -> None:
        # One machine-readable line, so scripts and tests can find the port; the HTTP port
        # comes before the metrics port, which tools read as the line's last part.
        host = config.host
        http = f" (http on {host}:{server.http_port})" if server.http_port else ""
        metrics = f" (metrics on {host}:{server.metrics_port})" if server.metrics_port else ""
        print(f"cadence serving on {host}:{port}{http}{metrics}", flush=True)

    try:
        if config.grpc_server == "native":
            from cadence.lifecycle import envoy_front

            event_loop.run(
                envoy_front.run_in_envoy(config, on_started=announce, log_level=args.log_level)
            )
        else:
            event_loop.run(run_server(config, on_started=announce))
    except (StartupError, ServingFailed) as exc:
        sys.exit(f"cadence serve: {exc}")


def _server_config(args: argparse.Namespace):
    """The ServerConfig of `cadence serve`'s parsed flags (those given: see `_flag`)."""
    from cadence.config import serve_options, server_config

    given = vars(args)
    return server_config({o.name: given[o.name] for o in serve_options() if o.name in given})


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream one request's text to the terminal")
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of a cadence server")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, sent with the request")
    from cadence.credentials import add_arguments

    add_arguments(p)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> None:
    import grpc

    from cadence.client import Client
    from cadence.credentials import from_arguments

    try:
        credentials = from_arguments(args)
    except ValueError as exc:
        sys.exit(f"cadence generate: {exc}")
    with Client(args.target, credentials=credentials) as client:
        try:
            for chunk in client.generate(
                args.prompt, max_tokens=args.max_tokens, timeout=args.timeout, seed=args.seed
            ):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except grpc.RpcError as exc:
            sys.stdout.write("\n")
            sys.exit(f"cadence generate: {exc.code().name}: {exc.details()}")
    sys.stdout.write("\n")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a CPU server, stream a few requests, run a short bench")
    p.add_argument("--workers", type=int, default=2, help="CPU workers of the demo's server")
    p.add_argument(
        "--step-ms", type=float, default=20.0, help="the synthetic engine's decode step (ms)"
    )
    p.add_argument("--streams", type=int, default=64, help="streams open at once in the bench")
    p.set_defaults(
        func=lambda a: __import__("cadence.lab.demo", fromlist=["run_demo"]).run_demo(
            a.workers, a.step_ms, a.streams
        )
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cadence")
    except PackageNotFoundError:
        return "unknown (cadence is not installed; no package metadata)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence",
        usage="%(prog)s [-h] [--version] COMMAND ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        prog="cadence",
        parser_class=_CommandParser,
        help=argparse.SUPPRESS,
    )
    _add_serve(sub)
    _add_generate(sub)
    _add_demo(sub)
    from cadence.lab.bench_cli import add_bench
    from cadence.lab.capacity_cli import add_capacity
    from cadence.lab.report_cli import add_report
    from cadence.lab.sweep_cli import add_sweep

    add_bench(sub)
    add_sweep(sub)
    add_capacity(sub)
    add_report(sub)
    # The commands listed once, in the description, rather than again as a positional.
    commands = "\n".join(f"  {a.dest:<10}{a.help}" for a in sub._choices_actions)
    parser.description = (
        f"{__doc__}\n\ncommands (cadence COMMAND -h for each one's flags):\n{commands}"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `cadence` command."""
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
