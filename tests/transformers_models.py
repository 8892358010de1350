"""Tiny random checkpoints of several transformers architectures, for `--engine transformers`.

Each is built from a config made here (2 layers, hidden 32-64, the test tokenizer's ~320
tokens), saved with save_pretrained and the BPE tokenizer of tests/llama_models.py; no
download. Architectures with sliding-window attention get a window of 8 tokens, so that
sequences of the tests outgrow it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.llama_models import build_tokenizer, save_tokenizer

SLIDING_WINDOW = 8

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mistral", "gpt2")


def _config(arch: str, vocab: int):
    import transformers as tf

    common = {
        "vocab_size": vocab,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
        "initializer_range": 0.05,
    }
    decoder = dict(
        common,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if arch == "llama":
        return tf.LlamaConfig(**decoder)
    if arch == "qwen2":
        return tf.Qwen2Config(**decoder)
    if arch == "qwen3":
        return tf.Qwen3Config(**decoder, head_dim=16)
    if arch == "mistral":
        return tf.MistralConfig(**decoder, sliding_window=SLIDING_WINDOW)
    if arch == "phi3":
        return tf.Phi3Config(**decoder)
    if arch == "gemma2":
        # One sliding-window layer and one global layer, as Gemma 2 alternates them.
        return tf.Gemma2Config(
            **decoder, head_dim=16, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16
        )
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **decoder,
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
    if arch == "gpt2":
        return tf.GPT2Config(**common, n_embd=32, n_layer=2, n_head=4, n_positions=256)
    raise ValueError(arch)


def save_checkpoint(folder: Path, arch: str, *, seed: int = 0, **overrides) -> Path:
    """Write a tiny random `arch` causal LM and the test tokenizer to `folder`; `overrides`
    set fields of its config."""
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    config = _config(arch, tok.get_vocab_size())
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers initialises biases to zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    model.eval().save_pretrained(folder)
    save_tokenizer(folder, tok)
    return folder


_MODELS: dict[Path, object] = {}


def generate_greedy(folder: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own `generate(do_sample=False)` continuation (it stops at EOS)."""
    from transformers import AutoModelForCausalLM

    model = _MODELS.get(folder)
    if model is None:
        model = _MODELS[folder] = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()
