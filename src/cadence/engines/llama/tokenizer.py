"""The model folder's own tokenizer (`tokenizer.json`, through the `tokenizers` library).

Text prompts are encoded the way transformers' `AutoTokenizer` encodes them by default: with
the special tokens that tokenizer.json's post-processor adds (a BOS for Llama). transformers 5
builds its fast tokenizer from tokenizer.json and, for such a file, does not change the
post-processor because of tokenizer_config.json's `add_bos_token` / `add_eos_token`; the
tests check this against the installed transformers. Output is detokenized incrementally per
sequence with the tokenizer's own decoder, special tokens skipped, so each generated token
comes with its piece of text (empty while a multi-byte character is incomplete).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cadence.engines.detokenizer import CONTEXT_TOKENS, ByteText, IncrementalDetokenizer


class TextTokenizer:
    """Encodes prompts and detokenizes output with a model folder's tokenizer.json."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, special tokens added as AutoTokenizer adds them by default."""
        return self._tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        """The text of a whole sequence of ids, special tokens skipped."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def stream(self, prompt_ids: list[int]) -> Callable[[int, bool], str]:
        """A per-sequence decoder: call it with each new token (and whether it is the last),
        get that token's piece of text."""
        return IncrementalDetokenizer(self.decode, prompt_ids[-CONTEXT_TOKENS:])


def load_tokenizer(folder: str | Path) -> TextTokenizer | ByteText:
    """The folder's tokenizer.json, or byte-level text when it has none."""
    if not (Path(folder) / "tokenizer.json").exists():
        return ByteText()
    return TextTokenizer(folder)
