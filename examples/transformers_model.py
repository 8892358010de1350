"""Serving a transformers causal LM with `--engine transformers`: build a tiny random
checkpoint in a local folder (no download), serve it, stream from it.

    pip install 'cadence[transformers]'
    python examples/transformers_model.py /tmp/tiny-qwen3    # writes the folder, prints the command
    cadence serve --engine transformers --model /tmp/tiny-qwen3 --devices cpu:2 --http-port 8000
    cadence generate "the quick brown fox" --max-tokens 20

Any folder that `AutoModelForCausalLM.from_pretrained(PATH)` and `AutoTokenizer` load works
the same way (a downloaded Hugging Face model, a fine-tune saved with save_pretrained); its
chat template serves /v1/chat/completions. See docs/models.md, "Any transformers model".
"""

from __future__ import annotations

import sys
from pathlib import Path

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stream of tokens leaves the card one step at a time",
    "cadence serves models over grpc and measures the latency",
] * 20

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build(folder: Path) -> Path:
    """A random 2-layer Qwen3 (hidden 64) and a byte-level BPE tokenizer trained on a few lines."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        _CORPUS,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.chat_template = _CHAT_TEMPLATE
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
    )
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    folder = build(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3"))
    print(f"cadence serve --engine transformers --model {folder} --devices cpu:2")
