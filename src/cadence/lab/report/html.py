"""HTML primitives of the report: escaping, number formatting, tables, figures, the page.

A section of the report is a string of markup, "" when it has nothing to show: `table`
gives "" for no rows and `section` gives "" when all its parts are empty, so no heading
or table stands alone.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

_CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1d232b;
       max-width: 1180px; margin: 1.5em auto; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em;
     border-bottom: 1px solid #d6dbe1; padding-bottom: 0.2em; } h3 { font-size: 1.05em; }
.sub { color: #5b6672; margin-top: 0; }
table { border-collapse: collapse; margin: 0.6em 0; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d6dbe1; padding: 3px 9px; text-align: right; }
th { background: #f1f4f7; } td:first-child, th:first-child { text-align: left; }
td.bad { background: #fde2e1; color: #8a1f17; font-weight: 600; }
.note { color: #5b6672; font-size: 0.92em; }
.finding { border-left: 4px solid #d9822b; background: #fff6ec; padding: 0.5em 0.8em;
           margin: 0.6em 0; } .finding .rule { font-weight: 600; }
.finding dl { margin: 0.3em 0 0; display: grid; grid-template-columns: max-content 1fr;
              gap: 0.15em 0.8em; } .finding dt { color: #5b6672; } .finding dd { margin: 0; }
.ok { color: #2f6f3e; font-weight: 600; }
.verdict { font-size: 1.1em; font-weight: 600; padding: 0.5em 0.8em; margin: 0.6em 0; }
.verdict.healthy { background: #e6f4ea; color: #2f6f3e; }
.verdict.unhealthy { background: #fde2e1; color: #8a1f17; }
.verdict.inconclusive { background: #fff6d6; color: #7a5a00; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #e3e7ec; }
figcaption { color: #5b6672; font-size: 0.92em; }
details { margin: 0.5em 0; } summary { cursor: pointer; font-weight: 600; }
pre { background: #f6f8fa; padding: 0.6em; overflow-x: auto; font-size: 0.88em; }
"""


class Raw:
    """Markup to put in a table cell as it is."""

    def __init__(self, markup: str) -> None:
        self.html = markup


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt(value: Any) -> str:
    """A number for a table cell: NaN and missing as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "—"
        if value == 0:
            return "0"
        if abs(value) < 1:
            return f"{value:.3f}"
        if abs(value) < 10_000:
            return f"{value:.2f}"
        return f"{value:,.0f}"
    if isinstance(value, (list, dict)):
        return esc(json.dumps(value)[:200])
    return esc(value)


def table(
    header: Sequence[str],
    rows: Iterable[Sequence[Any]],
    bad: Callable[[int, Any], bool] | None = None,
) -> str:
    """An HTML table, "" without rows; cells are formatted with `fmt` unless already markup
    (a `Raw`). `bad(column, cell)` marks the cells to highlight."""
    body = []
    for row in rows:
        body.append("<tr>")
        for i, cell in enumerate(row):
            text = cell.html if isinstance(cell, Raw) else fmt(cell)
            cls = ' class="bad"' if bad and bad(i, cell) else ""
            body.append(f"<td{cls}>{text}</td>")
        body.append("</tr>")
    if not body:
        return ""
    return "".join(
        [
            "<table><thead><tr>",
            *(f"<th>{esc(h)}</th>" for h in header),
            "</tr></thead><tbody>",
            *body,
            "</tbody></table>",
        ]
    )


def section(heading: str, *parts: str, level: int = 2) -> str:
    """A heading over its parts; "" when every part is empty (no orphan heading)."""
    body = "".join(parts)
    return f"<h{level}>{esc(heading)}</h{level}>{body}" if body else ""


def note(text: str) -> str:
    """A grey note of plain text."""
    return f'<p class="note">{esc(text)}</p>'


def figure(path: Path | None, caption: str) -> str:
    """A PNG embedded as a data URI, so the page needs no other file."""
    if path is None:
        return ""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return (
        f'<figure><img src="data:image/png;base64,{data}" alt="{esc(caption)}">'
        f"<figcaption>{esc(caption)}</figcaption></figure>"
    )


def page(title: str, subtitle: str, parts: Iterable[str]) -> str:
    """The whole document: inline CSS, no script and no external resource."""
    sub = f'<p class="sub">{esc(subtitle)}</p>' if subtitle else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{esc(title)}</h1>{sub}\n"
        + "\n".join(part for part in parts if part)
        + "</body></html>\n"
    )
