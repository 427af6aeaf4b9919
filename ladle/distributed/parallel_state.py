"""The tensor-parallel group one rank belongs to, and the collectives the sharded model calls.

torch.distributed carries the tensors: gloo on CPU, NCCL on CUDA. A group of one is the plain single-device
engine, whose collectives are no-ops, so the model code calls them unconditionally.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

# A collective waits this long for a peer before it raises: steps are short, and a dead peer is noticed at
# once anyway (gloo reports the closed connection), so this bounds only a peer that hangs.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules, samples, and is the only rank that sees the logits."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (each rank holds a partial sum of a row-parallel layer)."""
        if self.world_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dimension on rank 0 (vocab-parallel logits); None on
        the other ranks."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        torch.distributed.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def all_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of an integer list over the ranks (the memory plans agree on it)."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return [int(v) for v in t.tolist()]

    def all_gather_object(self, obj: object) -> list[object]:
        if self.world_size == 1:
            return [obj]
        out: list[object] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out


SINGLE = TensorParallel()


def check_no_process_group() -> None:
    if torch.distributed.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; a tensor-parallel ladle "
                           "engine needs its own process group (run it in a process of its own)")


def init_tensor_parallel(rank: int, world_size: int, store_port: int, device_type: str,
                         store: torch.distributed.TCPStore | None = None) -> TensorParallel:
    """Join the group whose rendezvous store listens on 127.0.0.1:store_port (rank 0 passes the store it
    created). The process's default torch.distributed group is the tensor-parallel group."""
    dist = torch.distributed
    check_no_process_group()
    if store is None:
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    backend = "nccl" if device_type == "cuda" else "gloo"
    device_id = torch.device("cuda", rank) if device_type == "cuda" else None  # None: init_process_group's default
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
                            device_id=device_id)
    return TensorParallel(rank, world_size)


def close_tensor_parallel() -> None:
    """Leave the group init_tensor_parallel joined (only a process that joined one calls this)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
