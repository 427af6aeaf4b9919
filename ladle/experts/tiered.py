"""A tiered MoE layer's forward: the same per-expert loop and order as the resident layer (ladle.models.ops
.each_expert), with each routed expert's weights taken from a cache slot (fetched on a miss) or, where the
strategy says so, computed where the expert lives; the arithmetic is the resident layer's, so greedy tokens
equal the resident model's token for token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from ladle.experts.cache import ExpertCache
from ladle.experts.compute import each_expert, expert_mlp

NEVER = -1  # a hybrid threshold below every token count: misses are always fetched


class LayerBacking(Protocol):
    nbytes: int

    def read_into(self, expert: int, dest: dict[str, torch.Tensor]) -> int: ...
    def expert(self, expert: int) -> dict[str, torch.Tensor]: ...


@dataclass
class MissPolicy:
    """What a miss does. offload: fetched into a slot; cpu: computed where the expert lives, never cached;
    hybrid: computed in place when it has at most in_place_max_tokens tokens this step, else fetched (the
    threshold set from the measured costs, ladle.experts.calibrate)."""
    strategy: str
    in_place_max_tokens: int = NEVER

    def in_place(self, tokens: int) -> bool:
        if self.strategy == "cpu":
            return True
        return self.strategy == "hybrid" and tokens <= self.in_place_max_tokens


# (compute dtype, tensors name -> [E, ...]) -> the (w13, w2) stacks a loop indexes by expert (FusedMoE._stacks)
StacksOf = Callable[[torch.dtype, dict[str, torch.Tensor]], tuple[Any, Any]]


class TieredExperts:
    """One MoE layer's routed experts: in `backing`, computed through `cache`'s slots or in place."""

    def __init__(self, layer: int, backing: LayerBacking, cache: ExpertCache, policy: MissPolicy,
                 num_experts: int) -> None:
        self.layer, self.backing, self.cache, self.policy = layer, backing, cache, policy
        self.num_experts = num_experts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, swiglu_limit: float | None,
                stacks_of: StacksOf) -> torch.Tensor:
        slot_w13, slot_w2 = stacks_of(x.dtype, self.cache.slot_tensors())
        counts: list[int] = []

        def mlp(rows: torch.Tensor, expert: int) -> torch.Tensor:
            slot = self.cache.lookup(self.layer, expert)
            if slot is None and self.policy.in_place(counts[expert]):
                return self._in_place(rows, expert, swiglu_limit, stacks_of)
            slot = self.cache.acquire(self.layer, expert, self.backing)
            try:
                return expert_mlp(rows, slot_w13, slot_w2, slot, swiglu_limit)
            finally:
                self.cache.release(slot)

        return each_expert(x, weights, ids, self.num_experts, mlp, counts.extend)

    def _in_place(self, rows: torch.Tensor, expert: int, swiglu_limit: float | None,
                  stacks_of: StacksOf) -> torch.Tensor:
        """The expert computed on the host from where it lives: host memory as it is, a file's bytes read for
        this step alone."""
        self.cache.stats.misses += 1
        self.cache.stats.computed_in_place += 1
        tensors = {name: t.unsqueeze(0) for name, t in self.backing.expert(expert).items()}
        w13, w2 = stacks_of(rows.dtype, tensors)
        host = rows.to("cpu")
        return expert_mlp(host, w13, w2, 0, swiglu_limit).to(rows.device)
