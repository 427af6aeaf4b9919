"""EngineConfig: every setting resolved at startup (with its provenance), the memory plan that sized them, the
KV cache layout and the CPU lending decision. It lives on the startup floor, which builds it, so its fields
carry their real types; the engine and the executor above read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ladle.config.provenance import Setting
from ladle.config.speculative import SpeculativeConfig
from ladle.startup.cpu_lending import CpuLending
from ladle.startup.partial_prefill import PartialPrefillLimits

if TYPE_CHECKING:  # the plan and the layout bring torch and the profiler: reading a config must stay light
    import torch

    from ladle.kv_cache.specs import KVCacheLayout
    from ladle.startup.kv_disk import KVDiskConfig
    from ladle.startup.planner import MemoryPlan


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    max_prefill_length: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    seed: int
    num_host_kv_blocks: int = 0  # the prefix cache's host tier, in blocks (ladle.kv_cache.host_tier); 0: none
    num_host_checkpoints: int = 0  # its state checkpoints (ladle.kv_cache.host_tier); 0: none
    kv_disk: KVDiskConfig | None = None  # the disk tier below it (ladle.startup.kv_disk); None: none
    enable_prefix_caching: bool = True
    # Models with per-request state (or compressed KV groups): the state checkpoints prefix hits resume from.
    num_state_checkpoints: int = 0
    state_checkpoint_interval: int = 512  # tokens between checkpoints while a request prefills
    max_cudagraph_capture_size: int = 0  # largest step (tokens) captured in a CUDA graph; 0 = eager only
    cudagraph_mode: str = "NONE"  # FULL | FULL_DECODE_ONLY | NONE (no graphs)
    async_scheduling: bool = False
    partial_prefills: PartialPrefillLimits | None = None  # None: the defaults (default_limits)
    scheduling_policy: str = "fcfs"
    attention_backend: str = "torch"  # ladle.attention.selector.resolve_backend's choice
    settings: dict[str, Setting] = field(default_factory=dict)
    plan: MemoryPlan | None = None  # what sized the memory settings
    kv_layout: KVCacheLayout | None = None  # the KV cache groups and what a block costs
    cpu_lending: CpuLending | None = None  # reserved CPUs the steps may borrow; None: none
    speculative: SpeculativeConfig | None = None  # drafts verified in each decode step; None: none

    def report(self) -> str:
        """The resolved settings with their provenance, then the memory plan and the KV cache groups."""
        lines = [self.table()]
        if self.plan is not None:
            lines += self.plan.lines()
        if self.kv_layout is not None:
            lines += self.kv_layout.lines()
        return "\n".join(lines)

    def table(self) -> str:
        rows = [(k, str(s.value), s.source, s.reason) for k, s in self.settings.items()]
        widths = [max(len(r[i]) for r in rows + [("setting", "value", "source", "")]) for i in range(3)]
        head = f"{'setting':<{widths[0]}}  {'value':<{widths[1]}}  {'source':<{widths[2]}}  reason"
        lines = [head] + [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
        return "\n".join(lines)
