"""Traces of production traffic, replayed: `cadence bench --trace FILE`.

A trace is a file of requests with their arrival times, one per JSONL line or CSV row:

- the Mooncake format: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (the ids
  of the prompt's blocks of `block_tokens` tokens, 512 in Mooncake's traces). Two requests
  whose `hash_ids` begin alike have prompts that begin alike, block by block: the replay
  makes each block's tokens from its id (`block`), so a server's prefix cache sees the
  reuse the trace recorded. The last block holds what is left of `input_length`.
- the plain format: `timestamp` (ms) and the two lengths, no `hash_ids`: each prompt is its
  own (no prefix shared).

`input_tokens`/`prompt_tokens` and `output_tokens`/`max_tokens` are read as the lengths where
`input_length`/`output_length` are absent. An optional `session_id` names the conversation a
request belongs to (sent as `--session-header`, and its turn counted by order of arrival).
In CSV, `hash_ids` is a JSON list (`"[1, 2, 3]"`) or ids separated by spaces.

`window` keeps the requests whose time from the trace's first request lies in [start, end)
seconds, and starts the replay at `start`; `speed` divides every time (2: twice as fast).

Every row is checked before any is replayed: `timestamp` a finite number, 0 or more; the
lengths whole numbers from 1 to MAX_LENGTH; `hash_ids` whole numbers, 0 or more; `session_id`
text or a number. TraceError names each bad row by its line and field, one line a row.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import random

import msgspec

BLOCK_TOKENS = 512
"""Tokens per hash block in Mooncake's traces."""

_INPUT = ("input_length", "input_tokens", "prompt_tokens")
_OUTPUT = ("output_length", "output_tokens", "max_tokens")


class TraceRow(msgspec.Struct, frozen=True, array_like=True):
    """One request of a trace, its time already windowed and scaled."""

    offset_s: float
    """When to send it, seconds from the replay's start."""
    input_length: int
    output_length: int
    hash_ids: list[int] = []
    session: str = ""
    turn: int = 0
    """Its place in its session (1 first), 0 outside one."""


class TraceError(ValueError):
    """The trace cannot be read; the message names the file, the line and what to fix, one
    line per bad row (at most `SHOWN_BAD_ROWS` of them, then how many more)."""


SHOWN_BAD_ROWS = 20
"""Bad rows named one per line before the rest are only counted."""

MAX_LENGTH = 10_000_000
"""The largest `input_length` or `output_length` taken: a prompt is made in memory, and a
mistyped length (a timestamp in the wrong column) must be refused, not allocated."""

_MAX_HASH_ID = 2**63 - 1


def read_trace(
    path: str, speed: float = 1.0, window: tuple[float, float | None] = (0.0, None)
) -> list[TraceRow]:
    """The requests of the trace at `path` (JSONL, or CSV by its `.csv` name), in time order,
    windowed and scaled (see the module's docstring); TraceError when it cannot be read."""
    return [row for _, row in numbered_trace(path, speed, window)]


def numbered_trace(
    path: str, speed: float = 1.0, window: tuple[float, float | None] = (0.0, None)
) -> list[tuple[int, TraceRow]]:
    """`read_trace`, each row with its line in the file (to name it in a message). Every row
    is checked before any is kept: TraceError names each bad one."""
    if not speed > 0:
        raise TraceError(f"--trace-speed must be positive, got {speed:g}")
    try:
        with open(path, newline="") as f:
            items = list(_csv_items(f) if path.lower().endswith(".csv") else _jsonl_items(f))
    except OSError as exc:
        raise TraceError(f"--trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(
            f"--trace {path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    except csv.Error as exc:
        raise TraceError(f"--trace {path}: not CSV ({exc})") from None
    rows, bad = [], []
    for n, item in items:
        try:
            rows.append((*_row(item), n))
        except _BadField as exc:
            bad.append(f"--trace {path}:{n}: {exc}")
    if bad:
        more = len(bad) - SHOWN_BAD_ROWS
        raise TraceError(
            "\n".join(
                bad[:SHOWN_BAD_ROWS]
                + ([f"--trace {path}: and {more} more bad rows"] if more > 0 else [])
            )
        )
    if not rows:
        raise TraceError(f"--trace {path} holds no requests")
    rows.sort(key=lambda r: r[0])
    first = rows[0][0]
    start, end = window
    kept: list[tuple[int, TraceRow]] = []
    turns: dict[str, int] = {}
    for at_ms, input_length, output_length, hash_ids, session, n in rows:
        since_s = (at_ms - first) / 1e3
        if since_s < start or (end is not None and since_s >= end):
            continue
        turn = 0
        if session:
            turn = turns[session] = turns.get(session, 0) + 1
        kept.append(
            (
                n,
                TraceRow(
                    (since_s - start) / speed, input_length, output_length, hash_ids, session, turn
                ),
            )
        )
    if not kept:
        raise TraceError(
            f"--trace {path}: no request in the window {start:g}:"
            f"{'' if end is None else f'{end:g}'} s (the trace spans "
            f"{(rows[-1][0] - first) / 1e3:g} s)"
        )
    return kept


def _jsonl_items(f):
    for n, line in enumerate(f, 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except ValueError as exc:
                yield n, _NotJson(str(exc))


class _NotJson(str):
    """A JSONL line that does not parse: why."""


def _csv_items(f):
    reader = csv.DictReader(f)
    for item in reader:
        yield reader.line_num, item


class _BadField(ValueError):
    """A row's field that cannot be used: its name and what is wrong, in one line."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}" if field else why)


def _row(item) -> tuple[float, int, int, list[int], str]:
    if isinstance(item, _NotJson):
        raise _BadField("", f"not JSON ({item})")
    if not isinstance(item, dict):
        raise _BadField("", f"expected an object of fields, got {_shown(item)}")
    at_ms = _number(item.get("timestamp"), "timestamp")
    input_length = _length(item, _INPUT)
    output_length = _length(item, _OUTPUT)
    hash_ids = item.get("hash_ids") or []
    if isinstance(hash_ids, str):
        text = hash_ids.strip()
        try:
            hash_ids = json.loads(text) if text.startswith("[") else text.split()
        except ValueError:
            raise _BadField("hash_ids", f"expected a list of ids, got {_shown(text)}") from None
    if not isinstance(hash_ids, list):
        raise _BadField("hash_ids", f"expected a list of ids, got {_shown(hash_ids)}")
    hash_ids = [_whole(h, "hash_ids", 0, _MAX_HASH_ID) for h in hash_ids]
    session = item.get("session_id")
    if isinstance(session, (dict, list)):
        raise _BadField("session_id", f"expected text or a number, got {_shown(session)}")
    return at_ms, input_length, output_length, hash_ids, "" if session is None else str(session)


def _length(item: dict, names: tuple[str, ...]) -> int:
    """The first of `names` the row gives, a whole number from 1 to MAX_LENGTH."""
    for name in names:
        if item.get(name) not in (None, ""):
            return _whole(item[name], name, 1, MAX_LENGTH)
    raise _BadField("", _missing(names[0]))


def _number(value, field: str) -> float:
    """A finite number, 0 or more (a CSV cell or a JSON number)."""
    if value in (None, ""):
        raise _BadField("", _missing(field))
    number = None
    if not isinstance(value, bool) and isinstance(value, (int, float, str)):
        with contextlib.suppress(ValueError, OverflowError):
            number = float(value)
    if number is None:
        raise _BadField(field, f"expected a number, got {_shown(value)}")
    if not math.isfinite(number) or number < 0:
        raise _BadField(field, f"expected a finite number, 0 or more, got {_shown(value)}")
    return number


def _whole(value, field: str, least: int, most: int) -> int:
    """A whole number from `least` to `most`: an int, an integral float or such text."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                pass
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _BadField(field, f"expected a whole number, got {_shown(value)}")
    if not least <= value <= most:
        raise _BadField(field, f"expected {least} or more (at most {most:,}), got {value}")
    return value


def _missing(field: str) -> str:
    return (
        f"no {field!r} (a trace row needs timestamp, input_length, output_length; "
        "hash_ids and session_id optional)"
    )


def _shown(value) -> str:
    """A value as the message shows it: short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def block(seed: int, hash_id: int, tokens: int) -> bytes:
    """The tokens of hash block `hash_id`: the same for the same id (and seed) in every
    request and process, printable ASCII ids (as the lab's other prompts)."""
    return printable(random.Random(seed * 1_000_003 + hash_id), tokens)


_PRINTABLE = bytes(32 + b % 95 for b in range(256))


def printable(rng: random.Random, tokens: int) -> bytes:
    """`tokens` random token ids in printable ASCII (32-126), one byte each: a prompt that
    reads the same as text (OpenAI), bytes (a gRPC `{prompt}`) and token ids."""
    return rng.randbytes(tokens).translate(_PRINTABLE)


_KEPT_BLOCKS = 8192
"""Blocks a load process keeps made (4 MiB of 512-token blocks): a block is made again,
in microseconds, when it was dropped."""


class Prompts:
    """Builds a trace row's prompt from its blocks, keeping the blocks made most recently."""

    def __init__(self, seed: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.seed = seed
        self.block_tokens = block_tokens
        self._blocks: dict[int, bytes] = {}

    def prompt(self, row: TraceRow, i: int) -> list[int]:
        """Row `i`'s prompt: its blocks in order, cut to its input length; a row without
        hash ids (or with fewer blocks than its length) gets tokens of its own."""
        out = bytearray()
        blocks = self._blocks
        for hash_id in row.hash_ids:
            if len(out) >= row.input_length:
                break
            made = blocks.pop(hash_id, None)
            if made is None:
                made = block(self.seed, hash_id, self.block_tokens)
                if len(blocks) >= _KEPT_BLOCKS:
                    del blocks[next(iter(blocks))]
            blocks[hash_id] = made  # last in: the most recently used
            out += made
        if len(out) < row.input_length:
            out += block(self.seed, -(i + 1), row.input_length - len(out))
        return list(out[: row.input_length])
