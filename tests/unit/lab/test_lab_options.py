"""The lab's options are declared once (cadence.lab.options), as `cadence serve`'s are: every
flag of `cadence bench`, `sweep` and `capacity` is one declared field's (or one of the client's
security flags, cadence.credentials.add_arguments, shared with `cadence generate`), no flag is
declared twice, and the lab's command lines add none of their own."""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import pytest

from cadence.lab import options
from cadence.lab.sweep import CLIENT_VARIABLES
from tests.unit.lab.test_lab_flags import subcommand

LAB = Path(options.__file__).parent
SECURITY = {"--tls", "--tls-ca", "--tls-cert", "--tls-key", "--token-file"}


def test_no_flag_is_declared_twice() -> None:
    declared = Counter(o.flag for cls in options.DECLARING for o in options.declared(cls))
    assert [flag for flag, count in declared.items() if count > 1] == []
    assert not SECURITY & set(declared)


@pytest.mark.parametrize("command", options.LAB)
def test_every_flag_of_a_lab_command_is_a_declared_option(command: str) -> None:
    declared = {o.flag: o for o in options.lab_options(command)}
    for action in subcommand(command)._actions:
        if isinstance(action, argparse._HelpAction) or set(action.option_strings) <= SECURITY:
            continue
        (flag,) = action.option_strings
        assert flag in declared, f"cadence {command} {flag} is declared outside lab/options.py"
        assert action.dest == declared.pop(flag).name
    assert declared == {}, f"declared for {command} but not its flags: {sorted(declared)}"


def test_the_lab_command_lines_add_no_flag_of_their_own() -> None:
    found = [
        f"{path.name}:{text[: m.start()].count(chr(10)) + 1}"
        for path in sorted(LAB.glob("*.py"))
        if path.name != "options.py"
        and path.name != "report_cli.py"  # `cadence report`'s own: in no other command
        for text in [path.read_text()]
        for m in re.finditer(r"\.add_argument\(", text)
    ]
    assert found == [], "declare the lab's flags in cadence/lab/options.py"


def test_the_sweeps_load_variables_are_the_declared_load_options() -> None:
    workload = {o.name for o in options.declared(options.WorkloadOptions)}
    assert set(CLIENT_VARIABLES) <= workload
    vary = next(a for a in subcommand("sweep")._actions if a.dest == "vary")
    for name in [*CLIENT_VARIABLES, *options.SERVER_VARIABLES]:
        assert name in vary.help
