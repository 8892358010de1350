"""What a new user meets first: a port in use and a card the host lacks are each refused in
one line of cadence's own; the synthetic engine's text starts at a word; the summary of a
bench against cadence does not offer py-spy (its timing says more, and the bench would not
run it); the README's first command installs what its quickstart runs."""

from __future__ import annotations

import pathlib
import re
import socket
import subprocess
import sys

import pytest

from cadence.client import Client
from cadence.engines import synthetic

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cadence.cli", "serve", "--host", "127.0.0.1", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--port", str(port), "--devices", "cpu:1")
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        (
            f"cadence serve: could not bind 127.0.0.1:{port}; is the port in use? Choose another "
            "with --port (0 picks a free one)"
        )
    ]


def test_a_card_the_host_lacks_is_refused_in_one_line() -> None:
    result = _serve("--port", "0", "--devices", "cuda:0,63")  # no host has card 63 visible
    assert result.returncode != 0
    (line,) = result.stderr.splitlines()
    assert line.startswith("cadence serve: --devices ") and "cuda:63" in line
    assert "cadence serving" not in result.stdout


def test_synthetic_text_starts_at_a_word(server) -> None:
    words = set(synthetic._WORDS)
    with Client(server.target) as client:
        for k in range(24):
            text = "".join(c.text for c in client.generate(f"prompt {k}", max_tokens=24))
            first = re.match(r"[A-Za-z]+", text)
            assert first and first.group().lower() in words, text


def test_a_bench_of_cadence_does_not_offer_py_spy(capsys) -> None:
    from cadence.lab.report import summary
    from tests.unit.lab.test_foreign_server_rules import threads_result

    # As where the lab extra was absent on the bench's host (the result records it).
    result = threads_result(
        [{"pid": 7, "python": True, "threads": 2, "cpu_pct": 50.0}], [], py_spy=False
    )
    assert result.workload.protocol == "cadence"
    summary.print_summary(result)
    assert "py-spy" not in capsys.readouterr().out
    # A foreign Python server's bench would sample its stacks: there the hint stays.
    assert "pip install py-spy" in summary.thread_lines(result.server_threads)[-1]


def test_the_first_command_installs_what_the_quickstart_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    first = next(
        line for line in readme.splitlines() if "cadence demo" in line and "pip install" in line
    )
    extras = set(re.search(r"-e '\.\[([^]]*)\]'", first).group(1).split(","))
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    if "cadence report" in quickstart:
        assert "lab" in extras, first  # its plots and HTML page


@pytest.fixture(scope="module")
def server():
    from tests.integration.conftest import start_server

    running = start_server("--devices", "cpu:1", "--step-ms", "2")
    yield running
    assert running.stop() == 0
