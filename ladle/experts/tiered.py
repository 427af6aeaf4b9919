"""A tiered MoE layer's forward: the same per-expert loop and order as the resident layer (ladle.experts.compute
.each_expert), with each routed expert's weights taken from a cache slot (fetched on a miss) or, where the
strategy says so, computed where the expert lives; the arithmetic is the resident layer's, so greedy tokens
equal the resident model's token for token."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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


# A step whose tokens route to at least this share of a layer's experts is a prefill chunk's: it will touch most
# of the next layer's too, so their fetches start while this layer computes.
STREAM_SHARE = 0.75


class TieredExperts:
    """One MoE layer's routed experts: in `backing`, computed through `cache`'s slots or in place. `next` is the
    following tiered layer, whose experts a prefill streams in while this one computes."""

    def __init__(self, layer: int, backing: LayerBacking, cache: ExpertCache, policy: MissPolicy,
                 num_experts: int) -> None:
        self.layer, self.backing, self.cache, self.policy = layer, backing, cache, policy
        self.num_experts = num_experts
        self.next: TieredExperts | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, swiglu_limit: float | None,
                stacks_of: StacksOf) -> torch.Tensor:
        slot_w13, slot_w2 = stacks_of(x.dtype, self.cache.slot_tensors())
        cache, counts = self.cache, []
        remaining: set[tuple[int, int]] = set()  # this layer's experts still to compute from a slot
        queue: deque[tuple[TieredExperts, int]] = deque()  # fetches to start ahead, in the order they run

        def plan(step_counts: list[int]) -> None:
            counts.extend(step_counts)
            routed = [e for e, n in enumerate(counts) if n]
            slotted = [e for e in routed if cache.coming(self.layer, e) or not self.policy.in_place(counts[e])]
            cache.settle_layer(self.layer, set(slotted))
            remaining.update((self.layer, e) for e in slotted)
            queue.extend((self, e) for e in slotted)
            if self.next is not None and len(routed) >= STREAM_SHARE * self.num_experts:
                queue.extend((self.next, e) for e in range(self.next.num_experts))
            top_up()

        def top_up() -> None:
            while queue and cache.prefetch_enabled:
                layer, expert = queue[0]
                if not cache.prefetch(layer.layer, expert, layer.backing, frozenset(remaining)):
                    return
                queue.popleft()

        def mlp(rows: torch.Tensor, expert: int) -> torch.Tensor:
            if (self.layer, expert) not in remaining:
                return self._in_place(rows, expert, swiglu_limit, stacks_of)
            slot = cache.acquire(self.layer, expert, self.backing, frozenset(remaining - {(self.layer, expert)}))
            try:
                return expert_mlp(rows, slot_w13, slot_w2, slot, swiglu_limit)
            finally:
                cache.release(slot)
                remaining.discard((self.layer, expert))
                top_up()

        try:
            return each_expert(x, weights, ids, self.num_experts, mlp, plan)
        except BaseException:
            cache.unpin_all()
            raise
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
