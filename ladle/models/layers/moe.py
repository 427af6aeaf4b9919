"""Mixture-of-experts MLP: a top-k softmax router and the experts' weights stacked into two tensors.

The experts of a layer are one `w13 [E, 2I, H]` (gate rows, then up rows) and one `w2 [E, H, I]`, filled at
load from the checkpoint's per-expert `experts.{j}.{gate,up,down}_proj.weight` (vLLM's FusedMoE layout), and
run by the model's ops (ladle.models.layers.ops): grouped torch matmuls that match HF, or Triton grouped GEMMs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ladle.distributed.parallel_state import SINGLE, TensorParallel
from ladle.experts.backing import HostBacking
from ladle.experts.tiered import TieredExperts
from ladle.kernels.cpu_kernels import CpuKernels
from ladle.models.interface import RoutedExperts
from ladle.models.layers.decoder_layer import GatedMLP
from ladle.models.layers.ops import OpsModule
from ladle.quantization.config import MXFP4_GROUP
from ladle.quantization.fp8_linear import Fp8ExpertStack, WidenBuffer
from ladle.quantization.layer_interfaces import QuantizableExperts, View
from ladle.quantization.mxfp4 import Mxfp4ExpertStack


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in dtype, expert ids [T, k]): softmax in fp32, top-k, and
    renormalised over the k when the config's norm_topk_prob says so (HF's order of operations)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def _expert(j: int, rows: slice | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The view of expert j's slot of a stacked parameter (rows: a part of its rows)."""
    return lambda p: p[j] if rows is None else p[j, rows]


class FusedMoE(OpsModule, QuantizableExperts):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 swiglu_limit: float | None = None) -> None:
        """names: the checkpoint's (gate, up, down) tensor names under `experts.{j}.` (DeepSeek's w1, w3, w2);
        swiglu_limit: clamp gate and up before the activation (DeepSeek-V4)."""
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported for experts; only 'silu'")
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.names, self.swiglu_limit = names, swiglu_limit
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Set by use_fp8 / use_mxfp4: "fp8" (block-scaled e4m3) or "mxfp4", the checkpoint's values kept as
        # they are, with scales of (rows, columns) each.
        self.weight_format: str | None = None
        self.scale_block = (1, 1)
        self.keep_dtypes: tuple[str, ...] = ()  # the stacks the loader's cast leaves alone (quantized ones)
        self.kernels: CpuKernels | None = None  # for quantized experts, set on CPU
        self.buffer: WidenBuffer | None = None  # the model's workspace a prefill widens an expert into
        # set by ladle.models.loading.expert_tiering: the experts live off the device
        self.tiered: TieredExperts | None = None

    @property
    def is_tiered(self) -> bool:
        return self.tiered is not None

    def use_cpu_kernels(self, kernels: CpuKernels, native_bf16: bool, buffer: WidenBuffer | None = None) -> None:
        self.kernels, self.buffer = kernels, buffer

    def fp8_checkpoint_parts(self, prefix: str) -> list[str]:
        return [f"{prefix}.{j}.{name}" for j in range(self.num_experts) for name in self.names]

    def use_fp8(self, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32) -> None:
        rows, cols = block
        e, size, hidden = self.num_experts, self.intermediate_size, self.w2.shape[1]
        if size % rows:
            raise ValueError(f"moe_intermediate_size {size} is off the {rows}-row FP8 block grid: the stacked "
                             "gate and up scales would share a block")
        fp8 = torch.float8_e4m3fn
        self._quantized("fp8", block, torch.empty(e, 2 * size, hidden, dtype=fp8),
                        torch.empty(e, hidden, size, dtype=fp8),
                        torch.empty(e, 2 * size // rows, -(-hidden // cols), dtype=scale_dtype),
                        torch.empty(e, -(-hidden // rows), -(-size // cols), dtype=scale_dtype))

    def use_mxfp4(self) -> None:
        """Hold the experts packed: two e2m1 values a byte, an E8M0 scale per 32 inputs (still on meta)."""
        e, size, hidden = self.num_experts, self.intermediate_size, self.w2.shape[1]
        if size % MXFP4_GROUP or hidden % MXFP4_GROUP:
            raise ValueError(f"MXFP4 experts need hidden_size ({hidden}) and moe_intermediate_size ({size}) to be "
                             f"multiples of {MXFP4_GROUP}, the inputs one scale covers")
        e8m0 = torch.float8_e8m0fnu
        self._quantized("mxfp4", (1, MXFP4_GROUP), torch.empty(e, 2 * size, hidden // 2, dtype=torch.int8),
                        torch.empty(e, hidden, size // 2, dtype=torch.int8),
                        torch.empty(e, 2 * size, hidden // MXFP4_GROUP, dtype=e8m0),
                        torch.empty(e, hidden, size // MXFP4_GROUP, dtype=e8m0))

    def _quantized(self, fmt: str, block: tuple[int, int], w13: torch.Tensor, w2: torch.Tensor,
                   w13_scales: torch.Tensor, w2_scales: torch.Tensor) -> None:
        self.w13, self.w2 = (nn.Parameter(t, requires_grad=False) for t in (w13, w2))
        self.w13_scale_inv, self.w2_scale_inv = (nn.Parameter(t, requires_grad=False) for t in (w13_scales, w2_scales))
        self.keep_dtypes = ("w13", "w2", "w13_scale_inv", "w2_scale_inv")
        self.weight_format, self.scale_block = fmt, block

    def dequantize(self, dtype: torch.dtype) -> None:
        stacks = self._stacks(dtype)
        self.w13, self.w2 = (nn.Parameter(torch.stack([s[e] for e in range(self.num_experts)]), requires_grad=False)
                             for s in stacks)
        del self.w13_scale_inv, self.w2_scale_inv
        self.keep_dtypes, self.weight_format, self.scale_block = (), None, (1, 1)

    def expert_names(self) -> tuple[str, ...]:
        """The stacked tensors that hold the experts (tiering moves them off the module)."""
        return ("w13", "w2", "w13_scale_inv", "w2_scale_inv") if self.weight_format else ("w13", "w2")

    def _stacks(self, dtype: torch.dtype, tensors: dict[str, torch.Tensor] | None = None) -> tuple[Any, Any]:
        """(w13, w2) indexable by expert in dtype: the parameters (or the given tensors of the same names),
        or views widening one expert when asked."""
        t = tensors if tensors is not None else {name: getattr(self, name) for name in self.expert_names()}
        if self.weight_format == "fp8":
            return (Fp8ExpertStack(t["w13"], t["w13_scale_inv"], self.scale_block, dtype, self.kernels, self.buffer),
                    Fp8ExpertStack(t["w2"], t["w2_scale_inv"], self.scale_block, dtype, self.kernels, self.buffer))
        if self.weight_format == "mxfp4":
            return (Mxfp4ExpertStack(t["w13"], t["w13_scale_inv"], dtype, self.kernels, self.buffer),
                    Mxfp4ExpertStack(t["w2"], t["w2_scale_inv"], dtype, self.kernels, self.buffer))
        return t["w13"], t["w2"]

    def tiered_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tiered in host memory: the host tensors the loader fills, by the parameter names they replace."""
        backing = self.tiered.backing if self.tiered is not None else None
        tensors = backing.tensors if isinstance(backing, HostBacking) else {}
        return {f"{prefix}.{name}": t for name, t in tensors.items()}

    def checkpoint_views(self, prefix: str) -> dict[str, tuple[str, View]]:
        size = self.intermediate_size
        views: dict[str, tuple[str, View]] = {}
        gate, up, down = self.names
        half = size // self.scale_block[0]  # the gate's rows of the stacked scale grid
        for j in range(self.num_experts):
            views[f"{prefix}.{j}.{gate}.weight"] = (f"{prefix}.w13", _expert(j, slice(None, size)))
            views[f"{prefix}.{j}.{up}.weight"] = (f"{prefix}.w13", _expert(j, slice(size, None)))
            views[f"{prefix}.{j}.{down}.weight"] = (f"{prefix}.w2", _expert(j))
            if self.weight_format is not None:
                views[f"{prefix}.{j}.{gate}.weight_scale_inv"] = (f"{prefix}.w13_scale_inv",
                                                                  _expert(j, slice(None, half)))
                views[f"{prefix}.{j}.{up}.weight_scale_inv"] = (f"{prefix}.w13_scale_inv",
                                                                _expert(j, slice(half, None)))
                views[f"{prefix}.{j}.{down}.weight_scale_inv"] = (f"{prefix}.w2_scale_inv", _expert(j))
        return views

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights and ids [T, k] -> [T, H]."""
        if self.tiered is not None:
            return self.tiered.forward(x, weights, ids, self.swiglu_limit, self._stacks)
        w13, w2 = self._stacks(x.dtype)  # quantized: each routed expert widened when the step reaches it
        return self.ops.fused_experts(x, w13, w2, weights, ids, self.swiglu_limit)


class SparseMoeBlock(RoutedExperts):
    """Router + experts, named as the checkpoint names them (`mlp.gate`, `mlp.experts`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))  # Qwen3.5-MoE's router always does
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                config.hidden_act)
        self.tp: TensorParallel = SINGLE  # experts sharded on their intermediate dimension when set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, x.dtype)
        if self.force_worst_routing:
            ids = torch.arange(self.top_k, device=x.device).expand_as(ids)
        return self.tp.all_reduce(self.experts(x, weights, ids))


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus one always-on shared expert scaled by a sigmoid gate (Qwen3.5-MoE, Qwen3-Next):
    `mlp.shared_expert.{gate,up,down}_proj` and `mlp.shared_expert_gate` in the checkpoint."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, False,
                                      config.hidden_act)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
