"""The model's non-attention ops as one object, chosen once when the model is loaded: the torch versions (the
HF-exact oracle, on CPU) or the fused Triton kernels (CUDA). Modules that use them are OpsModules, whose
`ops` set_ops fills in; nothing looks at a tensor's device to decide.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from ladle.attention.metadata import StateMetadata
from ladle.experts.compute import each_expert, expert_mlp


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


class TorchOps:
    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight multiply, exactly as HF does.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x
        return self.rms_norm(total, weight, eps), total

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if q_w is not None and k_w is not None:
            q, k = self.rms_norm(q, q_w, eps), self.rms_norm(k, k_w, eps)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    @staticmethod
    def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
        """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights and ids [T, k] -> [T, H]."""
        return each_expert(x, weights, ids, w13.shape[0],
                           lambda rows, expert: expert_mlp(rows, w13, w2, expert, swiglu_limit))

    @staticmethod
    def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         rec_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        from ladle.models.layers.delta_rule import torch_gated_delta_rule

        return torch_gated_delta_rule(q, k, v, g, beta, rec_state, meta)


class TritonOps:
    """Fused kernels: one launch where torch takes several; no host syncs, so decode steps can be captured in
    CUDA graphs. Tests run them in Triton's interpreter on CPU tensors."""

    name = "triton"

    def __init__(self) -> None:
        # flash-linear-attention (the `fla` extra) holds the maintained gated-delta-rule kernels; without it
        # the torch reference runs on the GPU too, correct but a launch per request and 64-token block.
        self.has_fla = importlib.util.find_spec("fla") is not None

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from ladle.kernels import triton_ops

        return triton_ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from ladle.kernels import triton_ops

        return triton_ops.fused_add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        from ladle.kernels import triton_ops

        return triton_ops.silu_and_mul(gate_up)

    @staticmethod
    def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from ladle.kernels import triton_ops

        return triton_ops.qk_norm_rope(q, k, q_w, k_w, cos, sin, eps)  # both norms and rotations, one launch

    @staticmethod
    def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
        from ladle.kernels import triton_moe

        return triton_moe.fused_experts(x, w13, w2, weights, ids, swiglu_limit=swiglu_limit)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, rec_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        from ladle.models.layers import delta_rule

        rule = delta_rule.fla_gated_delta_rule if self.has_fla else delta_rule.torch_gated_delta_rule
        return rule(q, k, v, g, beta, rec_state, meta)


ModelOps = TorchOps | TritonOps


class OpsModule(nn.Module):
    """A module whose kernels come from the model's ops object: TorchOps until set_ops gives it the device's."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: ModelOps = TorchOps()


def set_ops(model: nn.Module, ops: ModelOps) -> nn.Module:
    """Give every module of the model that uses ops these ones; returns the model."""
    for module in model.modules():
        if isinstance(module, OpsModule):
            module.ops = ops
    return model
