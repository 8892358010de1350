"""What one text output of a user's code may be, checked in the worker before it is sent.

A user's model (`step` or `generate_stream`) or app may return any `str` as one output. Two
kinds cannot go on: text UTF-8 cannot carry (a lone surrogate such as '\\ud800' makes the
worker's message unencodable), and a piece so large that the front, which decodes and frames
every step on one event loop, stops answering everything else while it handles it (10 MB
pieces stalled health and heartbeats until the workers gave up). Such an output fails its
step (a model) or its request (an app) with the message `text_problem` gives.

A text output's token ids are bounded too (MAX_OUTPUT_TOKENS), so that one output with its
ids always fits in one chunk the front sends (cadence.core.stream.MAX_CHUNK_BYTES: 1 MiB of
text plus 5 bytes per id stays under it); the text a tokenizer's `stream` gives for a token
is held to `text_problem` as well.
"""

from __future__ import annotations

MAX_OUTPUT_BYTES = 1 << 20
"""UTF-8 bytes one text output may hold (1 MiB): far above any piece a model streams (a token,
a word, a sentence), far below what stalls the front. A longer text goes out over several outputs."""

MAX_OUTPUT_TOKENS = 1 << 18
"""Token ids one output may hold (262,144): a text piece's encoding, or an app's piece. Without a
tokenizer ids are bytes, so a text piece then holds at most 256 KiB."""

_SURELY_SHORT = MAX_OUTPUT_BYTES // 4
"""Characters below which a text is within the bound whatever they are (at most 4 bytes each)."""


def text_problem(text: str) -> str | None:
    """Why `text` cannot be one output (the end of a sentence naming it), or None when it can.

    Costs a length check for ASCII text under the bound; other text is encoded once."""
    if len(text) < _SURELY_SHORT and text.isascii():
        return None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return (
            f"a text that UTF-8 cannot carry ({exc.reason}: {text[exc.start]!r} at "
            f"character {exc.start}); return valid Unicode text"
        )
    if size > MAX_OUTPUT_BYTES:
        return (
            f"a text of {size:,} bytes, over the {MAX_OUTPUT_BYTES:,} bytes (1 MiB) one "
            "output may hold; give a long text over several outputs"
        )
    return None


def ids_problem(count: int) -> str | None:
    """Why an output of `count` token ids cannot be one output (to follow "a text of"), or
    None when it can."""
    if count > MAX_OUTPUT_TOKENS:
        return (
            f"{count:,} token ids, over the {MAX_OUTPUT_TOKENS:,} one output may hold; "
            "give a long text over several outputs"
        )
    return None


def texts_problems(texts: list[str]) -> list[tuple[int, str]]:
    """The texts among `texts` (one step's, of several sequences) that `text_problem` finds
    fault with, as (index, problem); checked as one string first, so that a step of short
    ASCII or valid pieces costs one join and one check."""
    if not texts:
        return []
    joined = "".join(texts)
    if joined.isascii() and len(joined) <= MAX_OUTPUT_BYTES:
        return []
    try:
        if len(joined.encode("utf-8")) <= MAX_OUTPUT_BYTES:
            return []
    except UnicodeEncodeError:
        pass
    return [
        (i, problem) for i, text in enumerate(texts) if (problem := text_problem(text)) is not None
    ]
