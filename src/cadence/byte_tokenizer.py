"""A byte-level tokenizer: token id = byte value, so any text round-trips and output is readable.

Shared by the front (it tokenizes text prompts and decodes the synthetic engine's and apps'
tokens) and the workers, so it belongs to neither: the front imports no engine."""

from __future__ import annotations

import codecs


class ByteTokenizer:
    """Token ids 0..255 are the bytes of the UTF-8 text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Return the token ids of `text`."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        """Return the text of a whole sequence of token ids (invalid bytes become U+FFFD)."""
        return bytes(token_ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        """Return a decoder for one output stream, which holds back a split UTF-8 character."""
        return StreamDecoder()


class StreamDecoder:
    """Decodes a stream's chunks in order; bytes of a character split across chunks wait."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token_ids: list[int], final: bool = False) -> str:
        data = bytes(token_ids)
        decoder = self._decoder
        if not decoder.buffer and data.isascii():
            # Nothing held back and no multi-byte character: the codec's answer, without
            # its Python-level buffering (called once per chunk).
            return data.decode("ascii")
        return decoder.decode(data, final)
