"""A tensor-parallel group of processes, through torch.distributed.

One process per rank. Rank 0 is the worker that talks to the front; at every step it
broadcasts the packed batch plan, and every rank runs that step; inside the model the
row-parallel layers' partial sums meet in `all_reduce`. On CPU everything goes through gloo;
on CUDA activations go through NCCL while the plan (a small CPU tensor) still goes through
gloo, in one process group with a per-device backend.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_STEP, _STOP = 1, 0
_IDLE_TIMEOUT = datetime.timedelta(days=30)
"""Followers wait in a broadcast while rank 0 has no work; an idle server must not time out.
A rank that dies still fails its peers at once: its sockets close."""


class TensorParallelGroup:
    """This process's membership in its tensor-parallel group."""

    def __init__(self, rank: int, size: int, init_method: str, device: torch.device) -> None:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=_IDLE_TIMEOUT
        )
        self.rank = rank
        self.size = size
        self._header = torch.zeros(2, dtype=torch.int64)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""
        dist.all_reduce(tensor)

    def send_plan(self, packed: torch.Tensor) -> None:
        """Rank 0: give every rank this step's packed plan."""
        self._header[0] = _STEP
        self._header[1] = packed.numel()
        dist.broadcast(self._header, 0)
        dist.broadcast(packed, 0)

    def receive_plan(self) -> torch.Tensor | None:
        """Followers: wait for the next step's packed plan; None once rank 0 stops the group."""
        dist.broadcast(self._header, 0)
        if int(self._header[0]) == _STOP:
            return None
        packed = torch.empty(int(self._header[1]), dtype=torch.int64)
        dist.broadcast(packed, 0)
        return packed

    def stop(self) -> None:
        """Rank 0: tell the followers to leave their loop."""
        self._header[0] = _STOP
        self._header[1] = 0
        dist.broadcast(self._header, 0)

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
