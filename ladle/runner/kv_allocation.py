"""The KV cache and state tensors the plan sized, allocated once at startup."""
from __future__ import annotations

import torch

from ladle.kv_cache.specs import KVCacheLayout


def allocate_kv_caches(layout: KVCacheLayout, num_layers: int, num_blocks: int, device: torch.device,
                       num_state_slots: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """One (K, V) pair per paged layer, [num_blocks, block_size, kv heads, head dim] each; the i-th layer of
    every paged group shares pair i (a block belongs to one group at a time; see ladle.kv_cache.specs). A
    state layer gets its own tensors, [num_state_slots, *shape] for each of its spec's shapes."""
    spec = layout.groups[0].spec
    shape = (num_blocks, layout.block_size, spec.num_kv_heads, spec.head_dim)
    pairs = []
    for _ in range(layout.num_tensors):
        k = torch.zeros(shape, dtype=spec.dtype, device=device)
        pairs.append((k, k) if spec.kv_shared else (k, torch.zeros(shape, dtype=spec.dtype, device=device)))
    caches: list[tuple[torch.Tensor, ...]] = [pairs[i] if i >= 0 else () for _, i in layout.layer_slots(num_layers)]
    for group in layout.state_groups:
        for layer in group.layers:
            caches[layer] = tuple(torch.zeros((num_state_slots, *s), dtype=d, device=device)
                                  for s, d in zip(group.spec.shapes, group.spec.dtypes))
    return caches


def allocate_checkpoint_tails(layout: KVCacheLayout, num_checkpoints: int,
                              device: torch.device) -> dict[int, torch.Tensor]:
    """Per layer of a compressed group: one page per state checkpoint (a K and a V page unless key = value), the
    copy of that group's last partly filled block (ladle.kv_cache.state_checkpoints)."""
    if not num_checkpoints:
        return {}
    spec = layout.groups[0].spec
    shape = (num_checkpoints, 1 if spec.kv_shared else 2, layout.block_size, spec.num_kv_heads, spec.head_dim)
    return {layer: torch.zeros(shape, dtype=spec.dtype, device=device)
            for g in layout.tail_groups for layer in layout.groups[g].layers}
