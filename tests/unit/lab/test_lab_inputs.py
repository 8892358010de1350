"""The lab refuses bad input before it sends any load: an output path it could not write, a
trace with bad rows, a trace whose replay would wait far ahead. Each is `cadence ...` run as a
process against a closed port: it exits 2 with one line per fault, before it tries to connect
(a check made after connecting would say "no gRPC server answers" instead)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CLOSED = "127.0.0.1:1"


def cadence(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cadence.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def _lines(done: subprocess.CompletedProcess) -> list[str]:
    return done.stderr.strip().splitlines()


@pytest.mark.parametrize(
    ("command", "flag", "path", "why"),
    [
        (
            ["bench", "--target", CLOSED],
            "--json",
            "missing/run.json",
            "the folder {tmp}/missing does not exist",
        ),
        (["bench", "--target", CLOSED], "--export", ".", "is a folder; name a file"),
        (
            ["bench", "--target", CLOSED],
            "--export",
            "a-file/rows.csv",
            "{tmp}/a-file is not a folder",
        ),
        (
            ["capacity", "--target", CLOSED, "--search", "rate", "--slo", "ttft_p99_ms=100"],
            "--json",
            "missing/capacity.json",
            "the folder {tmp}/missing does not exist",
        ),
        (
            ["sweep", "--target", CLOSED, "--vary", "concurrency=1"],
            "--json",
            "missing/sweep.json",
            "the folder {tmp}/missing does not exist",
        ),
        (
            ["sweep", "--target", CLOSED, "--vary", "concurrency=1"],
            "--csv",
            ".",
            "is a folder; name a file",
        ),
        (
            ["sweep", "--target", CLOSED, "--vary", "concurrency=1"],
            "--report",
            "a-file/report",
            "{tmp}/a-file is not a folder",
        ),
        (["report", "run.json"], "--out", "a-file/report", "{tmp}/a-file is not a folder"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.startswith("--") else None,
)
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(
    tmp_path, command, flag, path, why
) -> None:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "run.json").write_text(json.dumps({"workload": {"target": CLOSED, "requests": 0}}))
    done = cadence(*command, flag, path, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    name = command[0]
    assert _lines(done) == [
        f"cadence {name}: {flag} {path}: " + why.format(tmp=tmp_path.resolve())
    ], done.stderr


BAD_ROWS = [
    (
        '{"timestamp": "soon", "input_length": 3, "output_length": 3}',
        "timestamp: expected a number",
    ),
    ('{"timestamp": NaN, "input_length": 3, "output_length": 3}', "timestamp: expected a finite"),
    ('{"timestamp": -5, "input_length": 3, "output_length": 3}', "timestamp: expected a finite"),
    ('{"timestamp": 1, "output_length": 3}', "no 'input_length'"),
    ('{"timestamp": 1, "input_length": 2.5, "output_length": 3}', "input_length: expected a whole"),
    (
        '{"timestamp": 1, "input_length": 3, "output_length": true}',
        "output_length: expected a whole",
    ),
    (
        '{"timestamp": 1, "input_length": 1e12, "output_length": 3}',
        "input_length: expected 1 or more",
    ),
    ('{"timestamp": 1, "input_length": 3, "output_length": 3, "hash_ids": [1e400]}', "hash_ids: "),
    ('{"timestamp": 1, "input_length": 3, "output_length": 3, "hash_ids": 7}', "hash_ids: "),
    ('{"timestamp": 1, "input_length": 3, "output_length": 3, "session_id": [1]}', "session_id: "),
    ("[1, 2, 3]", "expected an object of fields"),
    ('{"timestamp": 1,', "not JSON"),
]


def test_every_bad_trace_row_is_named_in_one_line_before_the_run(tmp_path) -> None:
    good = '{"timestamp": 0, "input_length": 3, "output_length": 3}'
    lines = [good] + [text for text, _ in BAD_ROWS] + [good]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    done = cadence("bench", "--target", CLOSED, "--trace", "t.jsonl", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    said = _lines(done)
    assert len(said) == len(BAD_ROWS), done.stderr  # one line a bad row, nothing else
    for row, (line, (_, why)) in enumerate(zip(said, BAD_ROWS, strict=True), 2):
        assert line.startswith(f"cadence bench: --trace t.jsonl:{row}: {why}"), line


def test_a_csv_trace_names_its_bad_cells_and_a_binary_file_is_one_line(tmp_path) -> None:
    (tmp_path / "t.csv").write_text(
        "timestamp,input_length,output_length\n0,3,3\nx,3,3\n1,3\n2,-1,3\n"
    )
    done = cadence("bench", "--target", CLOSED, "--trace", "t.csv", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert [line.split(": ")[1:3] for line in _lines(done)] == [
        ["--trace t.csv:3", "timestamp"],
        [
            "--trace t.csv:4",
            (
                "no 'output_length' (a trace row needs timestamp, input_length, "
                "output_length; hash_ids and session_id optional)"
            ),
        ],
        ["--trace t.csv:5", "input_length"],
    ]
    (tmp_path / "t.jsonl").write_bytes(b"\xff\xfe\x00 not text\n")
    done = cadence("bench", "--target", CLOSED, "--trace", "t.jsonl", cwd=tmp_path)
    assert done.returncode == 2 and _lines(done) == [
        "cadence bench: --trace t.jsonl: not UTF-8 text (invalid start byte at byte 0)"
    ]


def test_a_trace_row_far_ahead_is_refused_unless_a_duration_allows_it(tmp_path) -> None:
    rows = [{"timestamp": t, "input_length": 3, "output_length": 3} for t in (0, 10, 1e12)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = cadence("bench", "--target", CLOSED, "--trace", "t.jsonl", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert _lines(done) == [
        (
            "cadence bench: --trace t.jsonl: the replay would take 1e+09 s; the longest pause: "
            "1e+09 s, before row 3; give --duration S to replay that long, or cut it with "
            "--trace-window, --trace-speed or --requests"
        )
    ]
    # Allowed by a duration (or cut by --requests): the replay's length is said at its start.
    done = cadence(
        "bench", "--target", CLOSED, "--trace", "t.jsonl", "--duration", "5", cwd=tmp_path
    )
    assert _lines(done)[0] == (
        "cadence bench: replaying 2 requests of t.jsonl over 0.01 s "
        "(--duration 5 leaves out 1 later rows)"
    ), done.stderr
    done = cadence(
        "bench", "--target", CLOSED, "--trace", "t.jsonl", "--requests", "2", cwd=tmp_path
    )
    assert _lines(done)[0] == "cadence bench: replaying 2 requests of t.jsonl over 0.01 s"
