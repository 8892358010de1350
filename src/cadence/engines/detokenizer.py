"""Streaming text out of any tokenizer: what the worker needs (`encode`, and a per-sequence
`stream` that gives each new token's piece of text) made from an object that only has
`encode(text)` and `decode(ids)`, or from bytes when a model brings no tokenizer.

A token's piece is the text that decoding gained by it; while the newest tokens do not yet
form a whole character (the decoded text ends in U+FFFD, as byte-fallback and byte-level BPE
tokenizers give for a split character) the piece is empty and they wait, and the sequence's
last token flushes whatever waits. Decoding a short window of tokens instead of single ones
keeps merges right (a leading space, bytes that join into one character).
"""

from __future__ import annotations

import codecs
import inspect
from collections.abc import Callable, Iterable
from typing import Protocol, cast, runtime_checkable

CONTEXT_TOKENS = 6
"""Prompt tokens each sequence's decoder starts with, so the first output token's leading
space or merged bytes come out as they would in the whole text."""


class StreamingTokenizer(Protocol):
    """A tokenizer that streams on its own: the `tokenizer` contract of cadence.engines.base."""

    def encode(self, text: str, /) -> list[int]: ...

    def stream(self, prompt_ids: list[int], /) -> Callable[[int, bool], str]: ...


@runtime_checkable
class EncodeDecode(Protocol):
    """The least a tokenizer has: encode(text) (ids, or an Encoding with `.ids`) and decode(ids)."""

    def encode(self, text: str, /) -> object: ...

    def decode(self, token_ids: list[int], /) -> str: ...


class TextStreams:
    """A tokenizer with `encode` and `decode` only, given the worker's `stream`."""

    streams_with = "decode"
    """The user's method that `stream`'s decoders call (named when it raises)."""

    def __init__(self, tokenizer: EncodeDecode) -> None:
        self._encode: Callable[..., object] = tokenizer.encode  # add_special_tokens= if _plain
        self._decode = tokenizer.decode
        self.vocab_size: int | None = _vocab_size(tokenizer)
        self._plain = _takes_keyword(tokenizer.encode, "add_special_tokens")
        """encode takes add_special_tokens (transformers', `tokenizers`'): a piece of output
        text is encoded without the BOS or EOS that a prompt gets."""

    def encode(self, text: str) -> list[int]:
        """A prompt's ids, special tokens added as the tokenizer adds them."""
        return _ids(self._encode(text))

    def encode_piece(self, text: str) -> list[int]:
        """A piece of output text's ids: no special tokens where the tokenizer can leave them out."""
        return _ids(
            self._encode(text, add_special_tokens=False) if self._plain else self._encode(text)
        )

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(token_ids)

    def stream(self, prompt_ids: list[int]) -> Callable[[int, bool], str]:
        """A per-sequence decoder: call it with each new token (and whether it is the last)."""
        return IncrementalDetokenizer(self._decode, prompt_ids[-CONTEXT_TOKENS:])


class IncrementalDetokenizer:
    """One sequence's text, token by token (see the module docstring)."""

    __slots__ = ("_decode", "_ids", "_prefix", "_read")

    def __init__(self, decode: Callable[[list[int]], str], context: list[int]) -> None:
        self._decode = decode
        self._ids = list(context)
        self._prefix = 0
        """Start of the window decoded each time (a few tokens back, for context)."""
        self._read = len(context)
        """Tokens before this index have been given out as text."""

    def __call__(self, token: int, final: bool = False) -> str:
        ids = self._ids
        ids.append(token)
        done = self._decode(ids[self._prefix : self._read])
        text = self._decode(ids[self._prefix :])
        if len(text) > len(done) and (final or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(ids)
            return text[len(done) :]
        return ""


class ByteText:
    """No tokenizer: token ids 0..255 are the UTF-8 bytes of the text; ids beyond (a model
    whose vocabulary is larger, with no tokenizer at hand) have no text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    encode_piece = encode

    def decode(self, token_ids: list[int]) -> str:
        """The text of the byte ids, invalid bytes as U+FFFD."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def stream(self, prompt_ids: list[int]) -> Callable[[int, bool], str]:
        """A per-sequence incremental UTF-8 decoder (a split character waits for its bytes)."""
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode

        def piece(token: int, final: bool = False) -> str:
            return decode(bytes((token,)) if 0 <= token < 256 else b"", final)

        return piece


def text_streams(tokenizer: object | None) -> TextStreams | ByteText | StreamingTokenizer:
    """What the worker uses for a model's or app's `tokenizer`: bytes without one, the object
    itself when it streams on its own (has `stream`), else TextStreams over its encode/decode."""
    if tokenizer is None:
        return ByteText()
    if callable(getattr(tokenizer, "stream", None)):
        # Taken at its word: base's contract (encode and stream) is not checked here.
        return cast(StreamingTokenizer, tokenizer)
    for name in ("encode", "decode"):
        if not callable(getattr(tokenizer, name, None)):
            raise TypeError(
                f"the tokenizer, a {type(tokenizer).__name__}, has no {name}() method; "
                "give an object with encode(text) and decode(ids)"
            )
    assert isinstance(tokenizer, EncodeDecode)  # both checked callable just above
    return TextStreams(tokenizer)


def piece_encoder(text: TextStreams | ByteText | StreamingTokenizer) -> Callable[[str], list[int]]:
    """The encoder of output text pieces of what text_streams gave: `encode_piece` where it has one."""
    return getattr(text, "encode_piece", None) or text.encode


def prompt_decoder(
    text: TextStreams | ByteText | StreamingTokenizer,
) -> Callable[[list[int]], str] | None:
    """The decoder of prompts sent as token ids of what text_streams gave, or None: a
    tokenizer that streams on its own need not have `decode` (base's contract)."""
    decode = getattr(text, "decode", None)
    return decode if callable(decode) else None


def _ids(encoded: object) -> list[int]:
    """What an `encode` gave, as ids: the ids themselves, or `tokenizers`' Encoding (`.ids`)."""
    return list(cast(Iterable[int], getattr(encoded, "ids", encoded)))


def _takes_keyword(function: Callable, name: str) -> bool:
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _vocab_size(tokenizer: object) -> int | None:
    """The tokenizer's vocabulary size where it says (transformers', `tokenizers`'), or None."""
    size = getattr(tokenizer, "vocab_size", None)
    if callable(size):
        size = None
    get = getattr(tokenizer, "get_vocab_size", None)
    if size is None and callable(get):
        size = get(with_added_tokens=True)
    if isinstance(size, int):
        # transformers' vocab_size leaves added tokens out; len() counts them.
        try:
            size = max(size, len(tokenizer))  # type: ignore[arg-type]  # any object may have __len__; TypeError if not
        except TypeError:
            pass
        return size
    return None
