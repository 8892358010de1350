"""The lab's output paths (`--json`, `--export`, `--csv`, `--report`, `--out`): checked before
a run starts, so that a path that cannot be written is said in one line before any load is
sent rather than after the run as a traceback; and a write that still fails at the end (a
full disk) is said in one line too."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

EXIT_USAGE = 2
"""An output path that cannot be written, found before the run: a usage error."""


def unwritable_file(path: str) -> str | None:
    """Why a file cannot be written at `path` (a folder there, no such folder, no permission),
    in words; None when it can."""
    if os.path.isdir(path):
        return "is a folder; name a file"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "cannot be written (permission denied)"
    return _unwritable_parent(os.path.dirname(os.path.abspath(path)))


def unwritable_folder(path: str) -> str | None:
    """Why files cannot be written into the folder `path`, made with its parents when missing;
    None when they can."""
    full = os.path.abspath(path)
    if os.path.exists(full):
        if not os.path.isdir(full):
            return "is not a folder"
        return (
            None
            if os.access(full, os.W_OK | os.X_OK)
            else ("cannot be written into (permission denied)")
        )
    while not os.path.exists(full):  # the folder is made with its parents: the first that is
        full = os.path.dirname(full)
    return _unwritable_parent(full)


def _unwritable_parent(folder: str) -> str | None:
    if not os.path.exists(folder):
        return f"the folder {folder} does not exist"
    if not os.path.isdir(folder):
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} cannot be written into (permission denied)"
    return None


def check_outputs(
    command: str, files: dict[str, str | None], folders: dict[str, str | None] | None = None
) -> None:
    """Exit EXIT_USAGE with one line (per bad path) naming the flag and the path when one of
    the `files` (flag: path) or `folders` cannot be written; None paths are not asked for."""
    bad = [
        f"cadence {command}: {flag} {path}: {why}"
        for paths, check in ((files, unwritable_file), (folders or {}, unwritable_folder))
        for flag, path in paths.items()
        if path is not None and (why := check(path)) is not None
    ]
    if bad:
        print("\n".join(bad), file=sys.stderr)
        sys.exit(EXIT_USAGE)


@contextlib.contextmanager
def writing(command: str, flag: str, path: str, code: int = 1) -> Iterator[None]:
    """Write `flag`'s output inside: a write that fails (a full disk, a folder removed during
    the run) exits `code` with one line instead of a traceback."""
    try:
        yield
    except OSError as exc:
        print(
            f"cadence {command}: {flag} {path}: cannot write it: {exc.strerror or exc}",
            file=sys.stderr,
        )
        sys.exit(code)
