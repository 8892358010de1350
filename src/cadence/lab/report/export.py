"""`cadence bench --export FILE`: one row per request, as JSONL, CSV or Parquet (by the file's
name; Parquet needs the `parquet` extra, pyarrow), for a notebook or a spreadsheet; the JSON's raw records hold every chunk, this holds what a
request's own figures are.

Columns: the request's id, load process, status code, turn (0 outside a conversation),
prompt and output tokens, the tokens it asked for, its chunks, the cached prompt tokens the
server reported (empty when it did not), its send time in seconds from the run's first send,
and in ms: its dispatch delay (actual − scheduled send, open loop only), connect time (HTTP
only), TTFT, TTFT from the scheduled send, mean ITL, end to end; then its error message, its
client population and its request class (empty outside a mix).
A figure the request does not have (no chunk, a closed loop) is empty (null in JSONL).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable

from cadence.lab.analysis.stats import itl_points, ttft_ms
from cadence.lab.records import RequestRecord

COLUMNS = (
    "request_id",
    "process",
    "code",
    "turn",
    "prompt_tokens",
    "output_tokens",
    "max_tokens",
    "chunks",
    "cached_tokens",
    "sent_s",
    "dispatch_delay_ms",
    "connect_ms",
    "ttft_ms",
    "ttft_from_schedule_ms",
    "itl_mean_ms",
    "e2e_ms",
    "error",
    "population",
    "request_class",
)

_MS = 1e6


def rows(records: Iterable[RequestRecord]) -> list[dict]:
    """One dict per request, in send order, with the COLUMNS."""
    ordered = sorted(records, key=lambda r: r.start_ns)
    zero = ordered[0].start_ns if ordered else 0
    out = []
    for r in ordered:
        first = r.arrival_ns[0] if r.arrival_ns else None
        itl = [v for _, v in itl_points(r)]
        out.append(
            {
                "request_id": r.request_id,
                "process": r.process,
                "code": r.code,
                "turn": r.turn,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "max_tokens": r.max_tokens,
                "chunks": len(r.arrival_ns),
                "cached_tokens": r.cached_tokens if r.cached_tokens >= 0 else None,
                "sent_s": (r.start_ns - zero) / 1e9,
                "dispatch_delay_ms": (r.start_ns - r.scheduled_ns) / _MS
                if r.scheduled_ns
                else None,
                "connect_ms": r.connect_ns / _MS if r.connect_ns >= 0 else None,
                "ttft_ms": ttft_ms(r) if first else None,
                "ttft_from_schedule_ms": (first - r.scheduled_ns) / _MS
                if first and r.scheduled_ns
                else None,
                "itl_mean_ms": sum(itl) / len(itl) if itl else None,
                "e2e_ms": (r.arrival_ns[-1] - r.start_ns) / _MS if first else None,
                "error": r.error,
                "population": r.population,
                "request_class": r.request_class,
            }
        )
    return out


class ExportError(Exception):
    """The export cannot be written as asked (says what to do instead)."""


def check(path: str) -> None:
    """Raise ExportError, before any load is sent, when `path` asks for a format that cannot be
    written here."""
    if path.lower().endswith(".parquet"):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ExportError(
                f"{path}: Parquet needs pyarrow (pip install 'cadence[parquet]'), "
                "or name the file .csv or .jsonl"
            ) from None


def write(path: str, records: Iterable[RequestRecord]) -> int:
    """Write the rows to `path`: CSV when it ends in .csv, Parquet in .parquet, else JSONL;
    return how many."""
    table = rows(records)
    if path.lower().endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(table, schema=_parquet_schema(pa)), path)
        return len(table)
    with open(path, "w", newline="") as f:
        if path.lower().endswith(".csv"):
            writer = csv.DictWriter(f, COLUMNS)
            writer.writeheader()
            writer.writerows(table)
        else:
            f.writelines(json.dumps(row) + "\n" for row in table)
    return len(table)


def _parquet_schema(pa):
    """The COLUMNS' types, stated so that a column empty in every row keeps its type."""
    text, integer, number = pa.string(), pa.int64(), pa.float64()
    types = {
        "request_id": text,
        "code": text,
        "error": text,
        "population": text,
        "request_class": text,
        "sent_s": number,
        "itl_mean_ms": number,
    }
    types.update({c: number for c in COLUMNS if c.endswith("_ms")})
    return pa.schema([(c, types.get(c, integer)) for c in COLUMNS])
