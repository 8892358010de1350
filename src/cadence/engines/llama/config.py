"""The model's shape, read from a Hugging Face `config.json` or built for `tiny`.

Only the Llama family is accepted (LlamaForCausalLM, and Qwen2 / Mistral checkpoints that use
the same blocks). Anything the model code does not implement is refused here, before any
weight is read, with a message that names the config field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """The checkpoint needs something this engine does not implement; the message names it."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: base, and scaling of the Llama 3 (or linear) kind."""

    theta: float = 10000.0
    kind: str = "default"
    """`default`, `linear` or `llama3`."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    """Everything the model code needs to know about a checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    """q/k/v projections have a bias (Qwen2, or Llama with attention_bias)."""
    o_bias: bool = False
    """The output projection has a bias (Llama with attention_bias; not Qwen2)."""
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    """The checkpoint's own dtype (`torch_dtype` / `dtype`)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation by default (config, or generation_config.json)."""

    @property
    def params(self) -> int:
        """Number of parameters."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


def from_hf(config: dict[str, Any], generation: dict[str, Any] | None = None) -> LlamaConfig:
    """Validate a Hugging Face `config.json` (as a dict) and turn it into a LlamaConfig.

    Raises UnsupportedModel naming the first field this engine cannot honour.
    """
    archs = config.get("architectures") or ["LlamaForCausalLM"]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModel(
            f"architectures is {archs}; the torch engine serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = config.get("model_type", "llama")
    if config.get("quantization_config"):
        raise UnsupportedModel("quantization_config is set; only unquantized weights can be loaded")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act is {act!r}; only 'silu' (SwiGLU) is implemented")
    if config.get("use_sliding_window") or (
        model_type == "mistral" and config.get("sliding_window") is not None
    ):
        raise UnsupportedModel(
            "sliding_window / use_sliding_window is set; only full attention is implemented"
        )
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel(
            "partial_rotary_factor is not 1.0; only full-width rotary embeddings are implemented"
        )
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        if not isinstance(config.get(name), int) or config[name] < 1:
            raise UnsupportedModel(f"{name} must be a positive integer, got {config.get(name)!r}")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UnsupportedModel(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    if head_dim % 2:
        raise UnsupportedModel(f"head_dim must be even for rotary embeddings, got {head_dim}")
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
    eos = (generation or {}).get("eos_token_id", config.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return LlamaConfig(
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position=int(config.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_rope(config),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _rope(config: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x wrote `rope_theta` and
    # `rope_scaling` side by side. Accept both.
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(
            f"rope_scaling.rope_type is {kind!r}; implemented: {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise UnsupportedModel(f"rope_scaling of type {kind!r} needs a 'factor'")
    if kind == "linear":
        return RopeConfig(theta=theta, kind=kind, factor=float(params["factor"]))
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise UnsupportedModel(f"rope_scaling of type 'llama3' lacks {', '.join(missing)}")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position=int(
            params.get(
                "original_max_position_embeddings", config.get("max_position_embeddings", 8192)
            )
        ),
    )


def tiny() -> LlamaConfig:
    """The `--model tiny` shape: about 1M parameters over a byte vocabulary, for demos and tests."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position=2048,
    )
