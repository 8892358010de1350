"""Where a rank's weights come from: a local Hugging Face folder, or a seed for `tiny`.

A folder must hold `config.json` and `*.safetensors` of a LlamaForCausalLM-style model
(`generation_config.json` and `tokenizer.json` are used when present). Each rank reads only
its own slice of the sharded tensors (safetensors slices are read lazily), so a follower
never materialises the whole model. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from cadence.engines.llama.config import LlamaConfig, UnsupportedModel, from_hf, tiny
from cadence.engines.llama.model import LayerWeights, Shard, Weights

TINY = "tiny"

# fetch(name, dim, start, end): the tensor `name`, sliced to [start, end) along `dim` when
# dim is not None; None when the checkpoint lacks it.
Fetch = Callable[[str, "int | None", int, int], "torch.Tensor | None"]


class ModelFolderError(ValueError):
    """The model folder is missing something or holds something unexpected."""


def read_config(source: str) -> LlamaConfig:
    """The model's config: `tiny`, or the folder's config.json (validated)."""
    if source == TINY:
        return tiny()
    folder = Path(source)
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFolderError(
            f"--model {source!r} is neither 'tiny' nor a folder with a config.json"
        )
    config = json.loads(path.read_text())
    gen_path = folder / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    try:
        return from_hf(config, generation)
    except UnsupportedModel as exc:
        raise UnsupportedModel(f"{path}: {exc}") from None


def load_weights(
    source: str,
    config: LlamaConfig,
    *,
    shard: Shard,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    lm_head: bool = True,
) -> Weights:
    """This rank's weights from the folder `source`, or random ones from `seed` for `tiny`."""
    if source == TINY:
        return _build(config, _random_fetch(config, seed), shard, device, dtype, lm_head)
    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"{source} has no *.safetensors weights")
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def fetch(name: str, dim: int | None, start: int, end: int) -> torch.Tensor | None:
        handle = where.get(name)
        if handle is None:
            return None
        if dim is None:
            return handle.get_tensor(name)
        part = handle.get_slice(name)
        return part[start:end] if dim == 0 else part[:, start:end]

    return _build(config, fetch, shard, device, dtype, lm_head)


def _random_fetch(config: LlamaConfig, seed: int) -> Fetch:
    """Random weights drawn in a fixed order from `seed`, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "self_attn.q_proj.weight"] = (config.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.num_heads * d)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    # Drawn once, in order, so every rank sees the same full tensors before slicing.
    tensors = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}

    def fetch(name: str, dim: int | None, start: int, end: int) -> torch.Tensor | None:
        if name.endswith("norm.weight"):
            return torch.ones(h)
        t = tensors.get(name)
        if t is None or dim is None:
            return t
        return t[start:end] if dim == 0 else t[:, start:end]

    return fetch


def _build(
    config: LlamaConfig,
    fetch: Fetch,
    shard: Shard,
    device: torch.device,
    dtype: torch.dtype,
    lm_head: bool,
) -> Weights:
    d, h = config.head_dim, config.hidden_size
    heads = config.num_heads // shard.size
    kv_heads = config.num_kv_heads // shard.size
    inner = config.intermediate_size // shard.size

    def get(
        name: str, shape: tuple[int, ...], dim: int | None = None, width: int = 0
    ) -> torch.Tensor:
        start = shard.rank * width
        t = fetch(name, dim, start, start + width)
        if t is None:
            raise ModelFolderError(f"the checkpoint lacks tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ModelFolderError(
                f"tensor {name!r} has shape {tuple(t.shape)} (this rank's slice), expected {shape} "
                "from config.json"
            )
        return t.to(device=device, dtype=dtype)

    layers = []
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        m = p + "mlp."
        q_rows, kv_rows = heads * d, kv_heads * d
        qkv = torch.cat(
            [
                get(a + "q_proj.weight", (q_rows, h), 0, q_rows),
                get(a + "k_proj.weight", (kv_rows, h), 0, kv_rows),
                get(a + "v_proj.weight", (kv_rows, h), 0, kv_rows),
            ]
        )
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat(
                [
                    get(a + "q_proj.bias", (q_rows,), 0, q_rows),
                    get(a + "k_proj.bias", (kv_rows,), 0, kv_rows),
                    get(a + "v_proj.bias", (kv_rows,), 0, kv_rows),
                ]
            )
        gate_up = torch.cat(
            [
                get(m + "gate_proj.weight", (inner, h), 0, inner),
                get(m + "up_proj.weight", (inner, h), 0, inner),
            ]
        )
        gate_up_bias = None
        if config.mlp_bias:
            gate_up_bias = torch.cat(
                [
                    get(m + "gate_proj.bias", (inner,), 0, inner),
                    get(m + "up_proj.bias", (inner,), 0, inner),
                ]
            )
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight", (h,)),
                qkv=qkv,
                qkv_bias=qkv_bias,
                o=get(a + "o_proj.weight", (h, q_rows), 1, q_rows),
                # Row-parallel biases are added once, after the all-reduce: every rank holds all.
                o_bias=get(a + "o_proj.bias", (h,)) if config.o_bias else None,
                post_norm=get(p + "post_attention_layernorm.weight", (h,)),
                gate_up=gate_up,
                gate_up_bias=gate_up_bias,
                down=get(m + "down_proj.weight", (h, inner), 1, inner),
                down_bias=get(m + "down_proj.bias", (h,)) if config.mlp_bias else None,
            )
        )
    embed = get("model.embed_tokens.weight", (config.vocab_size, h))
    head = None
    if lm_head:
        if config.tie_word_embeddings:
            head = embed
        else:
            head = get("lm_head.weight", (config.vocab_size, h))
    return Weights(embed=embed, layers=layers, norm=get("model.norm.weight", (h,)), lm_head=head)
