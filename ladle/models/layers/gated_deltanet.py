"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): a short causal convolution and the gated delta rule,
with a fixed-size state per request carried from one prefill chunk to the next.

Per request and layer the state is the convolution's last kernel-1 inputs and the recurrent matrix
S [value heads, key dim, value dim] (fp32). The rule itself is a model op (ladle.models.layers.delta_rule: the torch
reference, or flash-linear-attention's kernel on CUDA); fp32 outputs match HF token for token whatever the
chunk sizes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ladle.attention.metadata import StateMetadata
from ladle.kv_cache.specs import StateSpec
from ladle.models.layers.decoder_layer import StackedLinear
from ladle.models.layers.ops import OpsModule


def state_spec(config: Any, dtype: torch.dtype) -> StateSpec:
    """A layer's state: the conv window in the model dtype (it holds projected inputs) and the recurrent state
    in fp32."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    conv_dim = 2 * key_dim + config.linear_num_value_heads * config.linear_value_head_dim
    recurrent = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    return StateSpec(((conv_dim, config.linear_conv_kernel_dim - 1), recurrent), (dtype, torch.float32),
                     "gated deltanet state")


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then a SiLU gate (HF's Qwen3_5RMSNormGated, FLA's FusedRMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * h.to(dtype)) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(OpsModule):
    """The linear-attention mixer; checkpoint names follow HF (`linear_attn.in_proj_qkv`, `.conv1d`, ...)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of linear_num_key_heads "
                             f"{self.num_k_heads}")
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.kernel = config.linear_conv_kernel_dim
        self.conv_dim = 2 * key_dim + value_dim
        # Two stacks, as vLLM's in_proj_qkvz and in_proj_ba: FP8 releases quantize the wide projections and
        # leave b and a (a row per value head, under one 128-row block) in bf16.
        self.in_proj_qkvz = StackedLinear(config.hidden_size, {"in_proj_qkv": self.conv_dim, "in_proj_z": value_dim},
                                          bias=False)
        self.in_proj_ba = StackedLinear(config.hidden_size, {"in_proj_b": self.num_v_heads,
                                                             "in_proj_a": self.num_v_heads}, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; state: this layer's (conv [slots, C, K-1], recurrent [slots, H, Dk, Dv])."""
        t = x.shape[0]
        mixed, z = self.in_proj_qkvz(x).split((self.conv_dim, self.in_proj_qkvz.out_features - self.conv_dim), -1)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)
        mixed = self._conv(mixed, state[0], meta)
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = mixed.split((key_dim, key_dim, self.conv_dim - 2 * key_dim), dim=-1)
        q, k = (y.view(t, self.num_k_heads, self.head_k_dim) for y in (q, k))
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = self.ops.gated_delta_rule(q, k, v, g, beta, state[1], meta).to(x.dtype)
        o = self.norm(o, z.view(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(t, -1))

    def _conv(self, mixed: torch.Tensor, conv_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """Depthwise causal conv + SiLU over each request's rows, its previous inputs from conv_state (zeros for
        a first chunk); the last kernel-1 inputs are written back. Decode rows go in one batched conv."""
        weight = self.conv1d.weight
        out = torch.empty_like(mixed)
        cu = meta.cu_seqlens_host
        decodes = meta.decodes()
        if decodes:
            rows = torch.tensor([cu[i] for i in decodes], device=mixed.device)
            slots = meta.slots[decodes] if len(decodes) < meta.num_seqs else meta.slots
            full = torch.cat((conv_state[slots], mixed[rows][:, :, None]), dim=-1)  # [B, C, K]
            out[rows] = F.silu(F.conv1d(full, weight, groups=self.conv_dim))[:, :, 0]
            conv_state[slots] = full[:, :, 1:]
        drafting = meta.drafting()
        for i in drafting:  # a decode token and its drafts, one at a time, each state kept for a rollback
            assert meta.draft_rows is not None  # drafting() lists requests only where draft_rows is set
            slot, keep = meta.slots_host[i], meta.draft_rows[i]
            for j, r in enumerate(range(cu[i], cu[i + 1])):
                full = torch.cat((conv_state[slot][None], mixed[r][None, :, None]), dim=-1)  # [1, C, K]
                out[r] = F.silu(F.conv1d(full, weight, groups=self.conv_dim))[0, :, 0]
                conv_state[slot] = full[0, :, 1:]
                if j < len(keep):
                    conv_state[keep[j]] = full[0, :, 1:]
        done = set(decodes) | set(drafting)
        for i, slot in enumerate(meta.slots_host):
            if i in done:
                continue
            rows = mixed[cu[i] : cu[i + 1]].t()[None]  # [1, C, L]
            prev = conv_state[slot][None] if meta.has_initial_state[i] else rows.new_zeros(1, self.conv_dim,
                                                                                           self.kernel - 1)
            full = torch.cat((prev, rows), dim=-1)
            out[cu[i] : cu[i + 1]] = F.silu(F.conv1d(full, weight, groups=self.conv_dim))[0].t()
            conv_state[slot] = full[0, :, full.shape[-1] - (self.kernel - 1):]
        return out
