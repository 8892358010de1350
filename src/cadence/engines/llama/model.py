"""The Llama decoder in plain PyTorch: RMSNorm, rotary embeddings, grouped-query attention with
optional q/k/v bias, SwiGLU MLP, and a paged KV cache.

One `LlamaModel` holds one tensor-parallel rank's shard (the whole model when there is one
rank). Megatron split: q/k/v and gate/up are column-parallel (each rank has a slice of the
heads and of the MLP's inner width), o and down are row-parallel (each rank has the matching
input slice), and their partial outputs are summed by one all-reduce each. Embeddings, norms
and the LM head are replicated; only rank 0 computes logits.

The math follows transformers' LlamaForCausalLM operation for operation (float32 RMSNorm
statistics, rotate-half RoPE with cos/sin cast to the model dtype), so greedy decoding gives
the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cadence.engines.llama.config import LlamaConfig, RopeConfig
from cadence.engines.llama.kv_cache import KVCache
from cadence.engines.llama.plan import StepInputs


@dataclass
class LayerWeights:
    """One decoder layer's tensors, already sharded for this rank (q/k/v and gate/up fused)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    """[(heads + 2 * kv_heads) * head_dim, hidden] for this rank's heads."""
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    """[hidden, heads * head_dim]: the input columns of this rank's heads."""
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    """[2 * inner, hidden]: gate rows then up rows of this rank's slice."""
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    """[hidden, inner]."""
    down_bias: torch.Tensor | None


@dataclass
class Weights:
    """A rank's share of the model."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor | None
    """None on tensor-parallel followers, which never compute logits."""


@dataclass(frozen=True)
class Shard:
    """Which slice of the heads and MLP a rank holds."""

    rank: int = 0
    size: int = 1


def check_shardable(config: LlamaConfig, tp: int) -> None:
    """Raise ValueError when the model cannot be split over `tp` ranks."""
    for name, value in (
        ("num_attention_heads", config.num_heads),
        ("num_key_value_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if value % tp:
            raise ValueError(f"{name} ({value}) is not divisible by --tp {tp}")


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies (float32) as transformers computes them, scaling included."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind != "llama3":
        return inv_freq
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 whatever the model dtype, as transformers does.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    """One rank's shard of the model; `forward` runs one step of a StepInputs."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: Weights,
        *,
        shard: Shard,
        context: int,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.config = config
        self.weights = weights
        self.shard = shard
        self.context = context
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.heads = config.num_heads // shard.size
        self.kv_heads = config.num_kv_heads // shard.size
        self.head_dim = config.head_dim
        self._all_reduce = all_reduce
        positions = torch.arange(context, dtype=torch.float32)
        freqs = positions[:, None] * inverse_frequencies(config.rope, config.head_dim)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self.device, self.dtype)
        self._sin = emb.sin().to(self.device, self.dtype)

    @torch.inference_mode()
    def forward(self, step: StepInputs, cache: KVCache) -> torch.Tensor | None:
        """Run every layer over the step's tokens, writing their keys and values to `cache`.

        Returns float32 logits [Bp + Bd, vocab] for each sequence's last token (prefilled
        sequences first), or None on a rank without the LM head.
        """
        w = self.weights
        eps = self.config.rms_norm_eps
        n = step.tokens.shape[0]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        q_width, kv_width = heads * d, kv_heads * d
        cos = self._cos[step.positions].unsqueeze(1)
        sin = self._sin[step.positions].unsqueeze(1)
        x = w.embed[step.tokens]
        for i, layer in enumerate(w.layers):
            h = _rms_norm(x, layer.input_norm, eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q = _rotate(qkv[:, :q_width].view(n, heads, d), cos, sin)
            k = _rotate(qkv[:, q_width : q_width + kv_width].view(n, kv_heads, d), cos, sin)
            v = qkv[:, q_width + kv_width :].view(n, kv_heads, d)
            keys, values = cache.keys[i], cache.values[i]
            keys.index_copy_(0, step.write_index, k)
            values.index_copy_(0, step.write_index, v)
            attn = self._attention(q, k, v, keys, values, step, cache.block_size)
            out = F.linear(attn.reshape(n, q_width), layer.o)
            if self._all_reduce is not None:
                self._all_reduce(out)
            if layer.o_bias is not None:
                out += layer.o_bias
            x = x + out
            h = _rms_norm(x, layer.post_norm, eps)
            gate, up = F.linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            out = F.linear(F.silu(gate) * up, layer.down)
            if self._all_reduce is not None:
                self._all_reduce(out)
            if layer.down_bias is not None:
                out += layer.down_bias
            x = x + out
        if w.lm_head is None:
            return None
        last = _rms_norm(x[step.last_index], w.norm, eps)
        return F.linear(last, w.lm_head).float()

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        step: StepInputs,
        block_size: int,
    ) -> torch.Tensor:
        """Attention for the flat layout: prompts attend to themselves (causal), chunks of
        prompts and decoded tokens to their cached past. Returns [N, heads, head_dim]."""
        parts: list[torch.Tensor] = []
        np_ = step.prefill_tokens
        if step.prefill_blocks is not None:
            # Chunks: each attends over its sequence's cache, its own keys already written.
            bp, width = step.prefill_count, step.prefill_width
            pad = step.prefill_pad_index
            assert pad is not None  # a chunked step always pads its prompts (plan.unpack)
            rows = q.new_zeros(bp * width, q.shape[1], q.shape[2]).index_copy_(0, pad, q[:np_])
            blocks = step.prefill_blocks
            shape = (bp, blocks.shape[1] * block_size, keys.shape[1], keys.shape[2])
            past_k = keys.view(-1, block_size, *keys.shape[1:])[blocks].view(shape).transpose(1, 2)
            past_v = (
                values.view(-1, block_size, *values.shape[1:])[blocks].view(shape).transpose(1, 2)
            )
            out = F.scaled_dot_product_attention(
                rows.view(bp, width, *q.shape[1:]).transpose(1, 2),
                past_k,
                past_v,
                attn_mask=step.prefill_mask,
                enable_gqa=True,
            )
            parts.append(out.transpose(1, 2).reshape(bp * width, *q.shape[1:])[pad])
        elif step.prefill_count == 1:
            # One prompt: no padding, so the causal kernel needs no mask.
            out = F.scaled_dot_product_attention(
                q[:np_].transpose(0, 1)[None],
                k[:np_].transpose(0, 1)[None],
                v[:np_].transpose(0, 1)[None],
                is_causal=True,
                enable_gqa=True,
            )
            parts.append(out[0].transpose(0, 1))
        elif step.prefill_count > 1:
            bp, width = step.prefill_count, step.prefill_width
            pad = step.prefill_pad_index
            assert pad is not None  # several prompts are always padded (plan.unpack)

            def padded(t: torch.Tensor) -> torch.Tensor:
                rows = t.new_zeros(bp * width, t.shape[1], t.shape[2]).index_copy_(0, pad, t[:np_])
                return rows.view(bp, width, t.shape[1], t.shape[2]).transpose(1, 2)

            out = F.scaled_dot_product_attention(
                padded(q), padded(k), padded(v), attn_mask=step.prefill_mask, enable_gqa=True
            )
            parts.append(out.transpose(1, 2).reshape(bp * width, *q.shape[1:])[pad])
        if step.decode_count:
            bd = step.decode_count
            assert (
                step.decode_blocks is not None
            )  # decoded sequences carry their blocks (plan.unpack)
            blocks = step.decode_blocks
            shape = (bd, blocks.shape[1] * block_size, keys.shape[1], keys.shape[2])
            past_k = keys.view(-1, block_size, *keys.shape[1:])[blocks].view(shape).transpose(1, 2)
            past_v = (
                values.view(-1, block_size, *values.shape[1:])[blocks].view(shape).transpose(1, 2)
            )
            out = F.scaled_dot_product_attention(
                q[np_:, :, None, :], past_k, past_v, attn_mask=step.decode_mask, enable_gqa=True
            )
            parts.append(out[:, :, 0, :])
        return parts[0] if len(parts) == 1 else torch.cat(parts)
