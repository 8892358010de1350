"""The tests' byte-level BPE tokenizer (about 320 tokens, a `tokenizers.Tokenizer` trained
here on a small corpus: nothing downloaded), apart from tests/llama_models.py so that worker
processes can build it without importing torch."""

from __future__ import annotations

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stream of tokens leaves the card one step at a time",
    "héllo wörld, ünïcode tëxt and 你好 too",
    "cadence serves models over grpc and measures the latency",
] * 20


def build_tokenizer():
    """A byte-level BPE tokenizer (about 320 tokens) that adds <s> in front, as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok
