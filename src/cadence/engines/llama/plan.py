"""One engine step's batch plan: which tokens run, at which positions, into which cache blocks.

Rank 0 of a tensor-parallel group builds a `StepPlan` from its scheduler's sequences, packs it
into one int64 tensor and broadcasts it; every rank (rank 0 included) unpacks the same tensor
into the same `StepInputs`, so all ranks run exactly the same step and followers keep no
per-sequence state at all.

The step's tokens are laid out flat: the prompts of the sequences being prefilled, one after
the other, then one token for each sequence being decoded. Dense layers run on that flat
layout with no padding; only attention treats the two groups differently.

A prefilled "prompt" may be a chunk of one (chunked prefill under a step budget): the tokens
from position `start` on, whose keys and values are appended to what the cache holds for the
sequence. A step where any chunk starts past 0 runs prefill attention over the cache (the
chunk attends to everything before it), not over the chunk alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_HEADER = 5  # prefill count, decode count, prefill table width, decode table width, prefill tokens
# then each prefill's length and start position, the prompts' tokens, the tables, ...


@dataclass
class StepPlan:
    """What rank 0 decided for one step, as plain lists."""

    prefill_tokens: list[list[int]]
    """The whole prompt of every sequence admitted in this step."""
    prefill_blocks: list[list[int]]
    """Each admitted sequence's cache blocks (all it may need, reserved at admission)."""
    decode_tokens: list[int]
    """The last token of every running sequence: the input of its next position."""
    decode_positions: list[int]
    """The position of that token (the sequence's length so far, minus one)."""
    decode_blocks: list[list[int]]
    prefill_starts: list[int] = field(default_factory=list)
    """The position of each prefill's first token (0 for a whole prompt; empty: all 0)."""

    def pack(self) -> torch.Tensor:
        """The plan as one int64 tensor (the form that is broadcast)."""
        wp = max((len(b) for b in self.prefill_blocks), default=0)
        wd = max((len(b) for b in self.decode_blocks), default=0)
        flat_prompt = [t for p in self.prefill_tokens for t in p]
        out: list[int] = [
            len(self.prefill_tokens),
            len(self.decode_tokens),
            wp,
            wd,
            len(flat_prompt),
        ]
        out += [len(p) for p in self.prefill_tokens]
        out += self.prefill_starts or [0] * len(self.prefill_tokens)
        out += flat_prompt
        for blocks in self.prefill_blocks:
            out += blocks
            out += [0] * (wp - len(blocks))
        out += self.decode_tokens
        out += self.decode_positions
        for blocks in self.decode_blocks:
            out += blocks
            out += [0] * (wd - len(blocks))
        return torch.tensor(out, dtype=torch.int64)


@dataclass
class StepInputs:
    """A packed plan turned into the tensors the model runs on (all on the model's device)."""

    tokens: torch.Tensor
    """[N] input token ids: prompts first, then one per decoded sequence."""
    positions: torch.Tensor
    """[N] position of each token in its sequence."""
    write_index: torch.Tensor
    """[N] flat cache slot (block * block_size + offset) that receives each token's key/value."""
    prefill_count: int
    prefill_tokens: int
    """Np: the first Np rows of the flat layout are prompt tokens."""
    prefill_pad_index: torch.Tensor | None
    """[Np] row of each prompt token in a padded [Bp * Tp] layout (None when Bp == 1)."""
    prefill_width: int
    """Tp: the longest prompt of the step."""
    prefill_mask: torch.Tensor | None
    """[Bp, 1, Tp, Tp] causal mask that also hides padding (None when Bp <= 1)."""
    decode_count: int
    decode_blocks: torch.Tensor | None
    """[Bd, W] cache blocks of each decoded sequence, zero-padded."""
    decode_mask: torch.Tensor | None
    """[Bd, 1, 1, W * block_size]: which gathered cache slots hold this sequence's past."""
    last_index: torch.Tensor
    """[Bp + Bd] row of each sequence's last token: the rows whose logits are needed."""
    prefill_blocks: torch.Tensor | None = None
    """[Bp, Wp] cache blocks of each prefilled sequence, set when a chunk starts past 0: the
    prefill then attends over the cache (prefill_mask is [Bp, 1, Tp, Wp * block_size])."""


def unpack(packed: torch.Tensor, block_size: int, device: torch.device) -> StepInputs:
    """Turn a packed plan into model inputs; the same tensor gives the same inputs on every rank."""
    bp, bd, wp, wd, np_ = packed[:_HEADER].tolist()
    at = _HEADER
    lens = packed[at : at + bp]
    at += bp
    starts = packed[at : at + bp]
    at += bp
    prompt = packed[at : at + np_]
    at += np_
    ptable = packed[at : at + bp * wp].view(bp, wp)
    at += bp * wp
    dtokens = packed[at : at + bd]
    at += bd
    dpos = packed[at : at + bd]
    at += bd
    dtable = packed[at : at + bd * wd].view(bd, wd)

    chunked = bp > 0 and bool(starts.any())
    if bp:
        seq_of = torch.repeat_interleave(torch.arange(bp), lens)
        rows = torch.cumsum(lens, 0) - lens
        offset = torch.arange(np_) - rows[seq_of]
        ppos = offset + starts[seq_of]
        pwrite = ptable[seq_of, ppos // block_size] * block_size + ppos % block_size
        width = int(lens.max())
        last = rows + lens - 1
    else:
        ppos = pwrite = last = torch.empty(0, dtype=torch.int64)
        width = 0
    pad_index = mask = None
    if chunked:
        # Query row j of sequence i sits at position starts[i] + j and sees every cache slot
        # up to it (rows past a chunk's end are padding, dropped after attention).
        pad_index = seq_of * width + offset
        query = starts[:, None] + torch.arange(width)[None, :]
        slots = torch.arange(wp * block_size)
        mask = (slots[None, None, :] <= query[:, :, None])[:, None]
    elif bp > 1:
        pad_index = seq_of * width + ppos
        keys = torch.arange(width)
        causal = keys[None, :] <= keys[:, None]
        mask = (causal[None] & (keys[None, None, :] < lens[:, None, None]))[:, None]
    dmask = None
    if bd:
        dwrite = dtable[torch.arange(bd), dpos // block_size] * block_size + dpos % block_size
        slots = torch.arange(wd * block_size)
        dmask = (slots[None, :] <= dpos[:, None])[:, None, None, :]
        last = torch.cat([last, torch.arange(np_, np_ + bd)])
    else:
        dwrite = torch.empty(0, dtype=torch.int64)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    def put_optional(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else put(t)

    return StepInputs(
        tokens=put(torch.cat([prompt, dtokens])),
        positions=put(torch.cat([ppos, dpos])),
        write_index=put(torch.cat([pwrite, dwrite])),
        prefill_count=bp,
        prefill_tokens=np_,
        prefill_pad_index=put_optional(pad_index),
        prefill_width=width,
        prefill_mask=put_optional(mask),
        decode_count=bd,
        decode_blocks=put(dtable) if bd else None,
        decode_mask=put_optional(dmask),
        last_index=put(last),
        prefill_blocks=put(ptable) if chunked else None,
    )
