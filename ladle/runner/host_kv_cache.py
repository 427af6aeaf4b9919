"""The host tier's tensors (ladle.kv_cache.host_tier): for each distinct tensor of the paged KV pool, num_slots
blocks in host memory (pinned where the pool is on a GPU), and the copies each step's StateUpdate asks for.

Every paged group's i-th layer shares the pool's i-th tensors (ladle.runner.kv_allocation), so a slot keeps a
block of any group by copying that block of every tensor."""
from __future__ import annotations

import torch


class HostKVCache:
    def __init__(self, pool_tensors: list[torch.Tensor], num_slots: int) -> None:
        """pool_tensors: the paged pool's distinct tensors, [num_blocks, ...] each."""
        self.pool = pool_tensors
        pin = any(t.is_cuda for t in pool_tensors)
        self.host = [torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in pool_tensors]

    @torch.no_grad()
    def save(self, copies: list[tuple[int, int]]) -> None:
        """(device block, host slot) pairs, in order: a slot saved twice keeps the later (its first entry was
        dropped from the tier within the step)."""
        last = {s: b for b, s in copies}
        blocks = torch.tensor(list(last.values()), dtype=torch.long)
        slots = torch.tensor(list(last), dtype=torch.long)
        for t, h in zip(self.pool, self.host):
            h[slots] = t[blocks.to(t.device)].to("cpu")

    @torch.no_grad()
    def load(self, copies: list[tuple[int, int]]) -> None:
        """(host slot, device block) pairs."""
        slots = torch.tensor([s for s, _ in copies], dtype=torch.long)
        blocks = torch.tensor([b for _, b in copies], dtype=torch.long)
        for t, h in zip(self.pool, self.host):
            t[blocks.to(t.device)] = h[slots].to(t.device)

    @torch.no_grad()
    def fill(self, fills: list[tuple[int, list[torch.Tensor]]]) -> None:
        """(host slot, pages) read from the disk tier: one block's page of every tensor, checked against the
        pool's dtypes and shapes when it was read (ladle.kv_cache.disk_format)."""
        for slot, pages in fills:
            for h, page in zip(self.host, pages, strict=True):
                h[slot].copy_(page)


class HostCheckpointCache:
    """The host tier's state checkpoints (ladle.kv_cache.host_tier): num_slots copies of a checkpoint's
    row in every state tensor and of its tail page in every compressed layer (ladle.runner.checkpoint_copier)."""

    def __init__(self, state_tensors: list[torch.Tensor], tails: list[torch.Tensor], first_checkpoint: int,
                 num_slots: int) -> None:
        """tails: allocate_checkpoint_tails' tensors, [num_checkpoints, ...] each, row r for checkpoint row
        first_checkpoint + r."""
        self.device = [*state_tensors, *tails]
        self.num_state = len(state_tensors)
        self.first_checkpoint = first_checkpoint
        pin = any(t.is_cuda for t in self.device)
        self.host = [torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in self.device]

    def rows(self, row: int) -> list[torch.Tensor]:
        """The device checkpoint row's views, one per state and tail tensor, in the host slots' order (the disk
        tier's checkpoint entries hold them so)."""
        return [t[row if i < self.num_state else row - self.first_checkpoint] for i, t in enumerate(self.device)]

    @torch.no_grad()
    def save(self, copies: list[tuple[int, int]]) -> None:
        """(device checkpoint row, host slot) pairs, in order (a slot saved twice keeps the later)."""
        for row, slot in copies:
            for h, t in zip(self.host, self.rows(row)):
                h[slot].copy_(t)

    @torch.no_grad()
    def load(self, copies: list[tuple[int, int]]) -> None:
        """(host slot, device checkpoint row) pairs."""
        for slot, row in copies:
            for h, t in zip(self.host, self.rows(row)):
                t.copy_(h[slot])

    @torch.no_grad()
    def fill(self, fills: list[tuple[int, list[torch.Tensor]]]) -> None:
        """(host slot, pages) read from the disk tier: a checkpoint's row of every state and tail tensor, checked
        against their dtypes and shapes when it was read (ladle.kv_cache.disk_format)."""
        for slot, pages in fills:
            for h, page in zip(self.host, pages, strict=True):
                h[slot].copy_(page)
