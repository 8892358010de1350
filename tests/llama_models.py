"""Tiny random Llama-family checkpoints written with transformers, and their reference outputs.

Tests save a model (and a small BPE tokenizer) to a temporary folder, serve or step it with
cadence, and compare with transformers' own `generate(do_sample=False)` on the same folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tests.bpe_tokenizer import CORPUS, build_tokenizer  # noqa: F401 - tests import them from here

if TYPE_CHECKING:
    from cadence.engines.llama.engine import LlamaEngine

PROMPTS = [
    "the quick brown fox",
    "a stream",
    "hello wörld 你好, the lazy dog jumps over cadence",
    "t",
]


def save_model(
    folder: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    tokenizer: bool = True,
    **overrides,
) -> Path:
    """Write a tiny random `LlamaForCausalLM` (or `Qwen2ForCausalLM`) checkpoint to `folder`.

    hidden 64, 2 layers, 4 heads, 2 KV heads; `overrides` go to the transformers config.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer() if tokenizer else None
    settings = {
        "vocab_size": tok.get_vocab_size() if tok else 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.05,
        "bos_token_id": 0 if tok else None,
        "eos_token_id": 1 if tok else None,
        "pad_token_id": None,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**settings))
    else:
        model = LlamaForCausalLM(LlamaConfig(**settings))
    if arch == "qwen2" or settings.get("attention_bias") or settings.get("mlp_bias"):
        # transformers initialises biases to zero; make them matter.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.1)
    model.eval().save_pretrained(folder)
    if tok is not None:
        save_tokenizer(folder, tok)
    return folder


def save_tokenizer(folder: Path, tok=None) -> Path:
    """Write the test tokenizer as transformers saves it (tokenizer.json, tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    tok = tok or build_tokenizer()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of `prompt_ids` (stops at EOS, as cadence does)."""
    from transformers import AutoModelForCausalLM

    model = _MODELS.get(folder)
    if model is None:
        model = _MODELS[folder] = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


_MODELS: dict[Path, object] = {}


def started_engine(folder: Path, **config) -> LlamaEngine:
    """cadence's torch engine on `folder` (EngineConfig fields in `config`), started on the CPU."""
    from cadence.config import EngineConfig
    from cadence.engines.llama.engine import LlamaEngine

    engine = LlamaEngine(EngineConfig(name="torch", model=str(folder), **config), "cpu")
    engine.start()
    return engine


def run_rank(
    folder: str, rank: int, size: int, init: str, requests: list[dict]
) -> list[list[int]] | None:
    """One tensor-parallel rank stepping `requests` (AddRequest fields, `sampling` as a dict of
    its fields, plus `join` step) through a BatchScheduler; rank 0 returns each request's
    tokens, the others follow and return None."""
    from cadence.config import EngineConfig
    from cadence.engines.llama.engine import LlamaEngine
    from cadence.vocabulary import AddRequest, Sampling
    from cadence.worker.batch_scheduler import BatchScheduler

    config = EngineConfig(name="torch", model=folder, kv_cache_tokens=1024, threads=1)
    engine = LlamaEngine(config, "cpu", rank=rank, group_size=size, dist_init=init)
    if rank > 0:
        engine.follow()
        return None
    engine.start()
    scheduler = BatchScheduler(engine, 0, 16)
    tokens: list[list[int]] = [[] for _ in requests]
    step = 0
    while step == 0 or scheduler.has_work or any(r["join"] >= step for r in requests):
        for i, r in enumerate(requests):
            if r["join"] == step:
                fields = {k: v for k, v in r.items() if k != "join"}
                fields["sampling"] = Sampling(**fields.get("sampling", {}))
                assert scheduler.add(AddRequest(i, **fields)) is None
        out = scheduler.step()
        for seq_id, token in zip(out.seq_ids if out else [], out.token_ids if out else []):
            tokens[seq_id].append(token)
        step += 1
    engine.close()
    return tokens


if __name__ == "__main__":
    import json
    import sys

    result = run_rank(
        sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
    )
    if result is not None:
        print(json.dumps(result))
