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


_ASCII = tuple(map(chr, range(128)))


class StreamDecoder:
    """Decodes a stream's chunks in order; bytes of a character split across chunks wait."""

    __slots__ = ("_clean", "_decode")

    def __init__(self) -> None:
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self._clean = True
        """No bytes wait in the decoder: nothing yet, or the last byte was ASCII (which no
        character continues), or the stream ended."""

    def __call__(self, token_ids: list[int], final: bool = False) -> str:
        # The common chunk, one ASCII token with nothing waiting, needs no decoder.
        if self._clean and len(token_ids) == 1 and token_ids[0] < 128:
            return _ASCII[token_ids[0]]
        data = bytes(token_ids)
        if self._clean and data.isascii():
            # Several ASCII tokens: the codec's answer without its Python-level buffering.
            return data.decode("ascii")
        if token_ids:
            self._clean = final or token_ids[-1] < 128
        return self._decode(data, final)
