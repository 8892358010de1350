"""A user's model across a tensor-parallel group (`--tp N` with `--engine MODULE:CLASS`).

Every rank runs the user's `step` with the same sequences, so the model's collectives inside
it (`torch.distributed.all_reduce`, ...) meet. Rank 0 is the worker that talks to the front:
before each step it broadcasts what the step is made of (the new sequences' requests, the
running ones' ids, and the sequences released since the last step), and the followers
rebuild the same `Sequence` objects and call the same methods. The process group is
torch.distributed's default one, made here before the model is constructed, so the model
uses it as it is (gloo on CPU; gloo for this plan and NCCL for tensors on CUDA).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from cadence.engines.base import Sequence
from cadence.vocabulary import AddRequest

log = logging.getLogger("cadence.model")


class _Plan(msgspec.Struct, array_like=True):
    released: list[int]
    prefill: list[AddRequest]
    decode: list[int]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Plan).decode


class StepGroup:
    """This rank's part in stepping one model over a tensor-parallel group."""

    def __init__(self, rank: int, size: int, dist_init: str, device: str) -> None:
        import torch

        from cadence.engines.llama.parallel import TensorParallelGroup

        self._torch = torch
        self._group = TensorParallelGroup(rank, size, dist_init, torch.device(device))
        self._released: list[int] = []

    def released(self, seq_id: int) -> None:
        """Rank 0: the followers release this sequence before the next step."""
        self._released.append(seq_id)

    def send_step(self, prefill: list[Sequence], decode: list[Sequence]) -> None:
        """Rank 0: tell the followers what the coming step is made of."""
        plan = _Plan(self._released, [s.request for s in prefill], [s.seq_id for s in decode])
        self._released = []
        payload = _encode(plan)
        # Length first, then the bytes, padded to the int64 elements the group broadcasts.
        framed = len(payload).to_bytes(8, "little") + payload + bytes(-len(payload) % 8)
        self._group.send_plan(self._torch.frombuffer(bytearray(framed), dtype=self._torch.int64))

    def follow(
        self,
        step: Callable,
        release: Callable[[Sequence], None],
        prepare: Callable[[list[Sequence]], None],
    ) -> None:
        """Followers: run every step rank 0 announces, until it stops the group."""
        running: dict[int, Sequence] = {}
        while (packed := self._group.receive_plan()) is not None:
            data = packed.numpy().tobytes()
            plan = _decode(data[8 : 8 + int.from_bytes(data[:8], "little")])
            for seq_id in plan.released:
                seq = running.pop(seq_id, None)
                if seq is not None:
                    release(seq)
            prefill = [Sequence(request) for request in plan.prefill]
            prepare(prefill)
            for seq in prefill:
                running[seq.seq_id] = seq
            decode = [running[seq_id] for seq_id in plan.decode]
            try:
                step(prefill, decode)
            except Exception as exc:
                log.error("step raised on a follower rank", exc_info=exc)
            for seq in prefill:
                seq.generated += 1
            for seq in decode:
                seq.generated += 1

    def close(self) -> None:
        """Rank 0 stops the followers; every rank leaves the group."""
        try:
            if self._group.rank == 0:
                self._group.stop()
        except Exception:
            pass
        self._group.close()
