"""How messages say a count: "1 sequence", "2 sequences" (not "1 sequences")."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` and `noun`, the noun plural unless the count is 1 (`plural`, else noun + "s")."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"
