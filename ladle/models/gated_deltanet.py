"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): a short causal convolution and the gated delta rule,
with a fixed-size state per request carried from one prefill chunk to the next.

Per request and layer the state is the convolution's last kernel-1 inputs and the recurrent matrix
S [value heads, key dim, value dim] (fp32). For token t: S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T;
o_t = S^T q_t. A prefill chunk runs the chunked form of that recurrence (the WY/UT transform inside chunks of
64, the state passed between them), starting from the request's stored state unless the chunk is its first;
a decode row runs one recurrent step. The maths follows the flash-linear-attention reference that HF
transformers mirrors, so fp32 outputs match HF token for token whatever the chunk sizes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ladle.attention.metadata import StateMetadata
from ladle.kv_cache.specs import StateSpec
from ladle.models.layers import StackedLinear

RULE_CHUNK = 64  # the chunked rule's block: intra-chunk work is quadratic in it, the scan linear in chunks


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's chunk. q, k [L, H, Dk] (already l2-normed, q scaled), v [L, H, Dv], g, beta [L, H], all
    fp32; state [H, Dk, Dv] fp32. Returns (o [L, H, Dv], the state after the chunk)."""
    length = q.shape[0]
    pad = (RULE_CHUNK - length % RULE_CHUNK) % RULE_CHUNK
    # [H, chunks, C, D]: heads first, the sequence cut into chunks of C.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(x.shape[1], -1, RULE_CHUNK, x.shape[2])
               for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1).reshape(x.shape[1], -1, RULE_CHUNK) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.ones(RULE_CHUNK, RULE_CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(-1)  # log of the decay from a chunk's start to each position
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # Solve (I + strictly-lower(beta K K^T * decay)) W = [V beta, K beta exp(cum)]: the UT transform that folds
    # the chunk's sequential delta updates into matmuls.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                              unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(q.shape[1]):
        v_new = values[:, i] - k_decayed[:, i] @ state  # what the old state does not already predict
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1), state


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv],
    all fp32. Returns (o [B, H, Dv], the new states)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


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


class GatedDeltaNet(nn.Module):
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
        self.sizes = (self.conv_dim, value_dim, self.num_v_heads, self.num_v_heads)
        self.in_proj = StackedLinear(config.hidden_size, dict(zip(
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), self.sizes)), bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; state: this layer's (conv [slots, C, K-1], recurrent [slots, H, Dk, Dv])."""
        t = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.sizes, dim=-1)
        mixed = self._conv(mixed, state[0], meta)
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = mixed.split((key_dim, key_dim, self.conv_dim - 2 * key_dim), dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        q, k = (y.view(t, self.num_k_heads, self.head_k_dim).float().repeat_interleave(repeat, dim=1) for y in (q, k))
        q = _l2norm(q) * self.head_k_dim**-0.5
        k = _l2norm(k)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim).float()
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = self._rule(q, k, v, g, beta, state[1], meta).to(x.dtype)
        o = self.norm(o, z.view(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(t, -1))

    def _conv(self, mixed: torch.Tensor, conv_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """Depthwise causal conv + SiLU over each request's rows, its previous inputs from conv_state (zeros for
        a first chunk); the last kernel-1 inputs are written back."""
        weight = self.conv1d.weight
        out = torch.empty_like(mixed)
        cu = meta.cu_seqlens_host
        for i, slot in enumerate(meta.slots_host):
            rows = mixed[cu[i] : cu[i + 1]].t()[None]  # [1, C, L]
            prev = conv_state[slot][None] if meta.has_initial_state[i] else rows.new_zeros(1, self.conv_dim,
                                                                                           self.kernel - 1)
            full = torch.cat((prev, rows), dim=-1)
            out[cu[i] : cu[i + 1]] = F.silu(F.conv1d(full, weight, groups=self.conv_dim))[0].t()
            conv_state[slot] = full[0, :, full.shape[-1] - (self.kernel - 1):]
        return out

    def _rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              rec_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """The gated delta rule over every request's rows: continuing one-token rows in one batched recurrent
        step, the others (prefill chunks) one request at a time in the chunked form."""
        cu = meta.cu_seqlens_host
        single = [i for i in range(meta.num_seqs) if cu[i + 1] - cu[i] == 1 and meta.has_initial_state[i]]
        out = torch.empty_like(v)
        if single:
            rows = torch.tensor([cu[i] for i in single], device=q.device)
            slots = meta.slots[single] if len(single) < meta.num_seqs else meta.slots
            o, new = recurrent_gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], rec_state[slots])
            out[rows] = o
            rec_state[slots] = new
        done = set(single)
        for i, slot in enumerate(meta.slots_host):
            if i in done:
                continue
            lo, hi = cu[i], cu[i + 1]
            start = rec_state[slot] if meta.has_initial_state[i] else rec_state.new_zeros(rec_state.shape[1:])
            out[lo:hi], rec_state[slot] = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                                                 beta[lo:hi], start)
        return out
