"""The device side of state checkpoints (ladle.kv_cache.state_checkpoints): copies between a request's state slot
and a checkpoint's row in every state tensor, and between a compressed group's partly filled block and the
checkpoint's tail page, in step order (a restore before the forward that reads it, a save right after the
forward that reached the position)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ladle.attention.groups import AttentionGroup
from ladle.kv_cache.specs import StateGroup
from ladle.kv_cache.state_checkpoints import CheckpointCopy
from ladle.runner.payload import ChunkSpec


class CheckpointCopier:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, ...]], state_groups: Sequence[StateGroup],
                 groups: Sequence[AttentionGroup], tails: dict[int, torch.Tensor], first_checkpoint: int) -> None:
        self.state_tensors = [t for g in state_groups for layer in g.layers for t in kv_caches[layer]]
        self.kv_caches = kv_caches
        self.group_layers = [g.layers for g in groups]
        self.tails = tails
        self.first_checkpoint = first_checkpoint

    def restore(self, copy: CheckpointCopy) -> None:
        """The checkpoint's state into the request's slot, its tail pages into the request's fresh blocks."""
        self._copy(copy, restore=True)

    def save(self, copy: CheckpointCopy) -> None:
        self._copy(copy, restore=False)

    @torch.inference_mode()
    def _copy(self, copy: CheckpointCopy, restore: bool) -> None:
        src, dst = (copy.checkpoint, copy.state_slot) if restore else (copy.state_slot, copy.checkpoint)
        for t in self.state_tensors:
            t[dst] = t[src]
        row = copy.checkpoint - self.first_checkpoint
        for g, block in enumerate(copy.tail_blocks):
            for layer in self.group_layers[g] if block >= 0 else ():
                tail = self.tails[layer]
                for j, page in enumerate(self.kv_caches[layer][: tail.shape[1]]):  # K (= V), or K and V
                    if restore:
                        page[block] = tail[row, j]
                    else:
                        tail[row, j] = page[block]

    def save_after(self, specs: list[ChunkSpec]) -> None:
        """The saves of the chunks a forward just ran (a step split for a retry saves with each part)."""
        for s in specs:
            if s.checkpoint is not None:
                self.save(s.checkpoint)
