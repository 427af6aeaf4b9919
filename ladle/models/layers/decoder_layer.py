"""Building blocks shared by the decoder-only models, written to match HF transformers numerically."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ladle.attention.backend import BackendMetadata
from ladle.distributed.parallel_state import SINGLE, TensorParallel
from ladle.models.layers.ops import OpsModule
from ladle.quantization.layer_interfaces import StackedProjections, View, narrow_rows

# Rope types whose inverse frequencies do not depend on the sequence length, so one table serves every step.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RMSNorm(OpsModule):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings as one dict with at least rope_type and rope_theta.

    transformers 5.x keeps them in config.rope_parameters; 4.x configs carry rope_theta and rope_scaling.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


class RotaryEmbedding(nn.Module):
    """cos/sin for explicit per-token positions; inv_freq comes from HF's own rope init functions."""

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        params = rope_parameters(config)
        self.rope_type: str = params["rope_type"]
        if self.rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {_STATIC_ROPE_TYPES}")
        self.rope_theta = float(params["rope_theta"])
        # Models with partial rope (Qwen3.5) rotate only the first rotary_dim dims of each head.
        self.rotary_dim = int(head_dim_of(config) * params.get("partial_rotary_factor", 1.0))
        self.layer_type: str | None = None  # the key of config.rope_parameters for models with several tables
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", torch.empty(self.rotary_dim // 2), persistent=False)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute inv_freq in fp32 on the buffer's device; the loader calls this after building on meta."""
        device = self.inv_freq.device
        if device.type == "meta":
            return
        if self.rope_type == "default":
            steps = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
            inv_freq, scaling = 1.0 / (self.rope_theta ** (steps / self.rotary_dim)), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            by_type = {"layer_type": self.layer_type} if self.layer_type else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device, **by_type)
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.attention_scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim] in dtype (computed in fp32 first, like HF)."""
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


class StackedLinear(nn.Linear, StackedProjections):
    """Several checkpoint projections of the same input as one matmul (vLLM's QKVParallelLinear and
    MergedColumnParallelLinear): one launch instead of three or two, which matters most for decode steps.
    `shards` maps each checkpoint module name to its rows, in output order."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        offsets = [0]
        for size in shards.values():
            offsets.append(offsets[-1] + size)
        self.shards = {name: (start, size) for (name, size), start in zip(shards.items(), offsets)}

    def checkpoint_views(self, prefix: str) -> dict[str, tuple[str, View]]:
        """Checkpoint name -> (parameter name, the rows that tensor fills): the shards are the checkpoint's
        sibling modules ('...self_attn.k_proj.weight' fills rows of '...self_attn.qkv_proj.weight')."""
        parent = prefix.rsplit(".", 1)[0]
        views: dict[str, tuple[str, View]] = {}
        for shard, (start, size) in self.shards.items():
            for kind, _ in self.named_parameters():
                views[f"{parent}.{shard}.{kind}"] = (f"{prefix}.{kind}", narrow_rows(start, size))
        return views


class GatedMLP(OpsModule):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, hidden_act: str) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; only 'silu'")
        # gate and up in one matmul; the loader fills each half from the checkpoint's gate_proj / up_proj.
        shards = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = StackedLinear(hidden_size, shards, bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        # down_proj is row-parallel when sharded (ladle.models.loading.tensor_parallel)
        self.tp: TensorParallel = SINGLE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))


class Attention(OpsModule):
    """Self-attention with GQA, optional per-head q/k RMSNorm (Qwen3), over the paged KV cache."""

    def __init__(self, config: Any, qk_norm: bool, qkv_bias: bool | None = None) -> None:
        """qkv_bias: q/k/v biases without an o_proj bias (Qwen2); None: config.attention_bias for all four."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of {self.num_kv_heads}")
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = StackedLinear(hidden, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
                                      bias if qkv_bias is None else qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias and qkv_bias is None)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.tp: TensorParallel = SINGLE  # o_proj is row-parallel when sharded (ladle.models.loading.tensor_parallel)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: BackendMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q_w = None if self.q_norm is None else self.q_norm.weight
        k_w = None if self.k_norm is None else self.k_norm.weight
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        q, k = self.ops.qk_norm_rope(q, k, q_w, k_w, cos, sin, eps)
        o = attn.backend(q, k, v, kv_cache[0], kv_cache[1], attn, self.scale)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.num_heads * self.head_dim)))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, qk_norm: bool, mlp: nn.Module, qkv_bias: bool | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, qk_norm, qkv_bias)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: BackendMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual): the residual add is deferred into the next norm, where
        CUDA fuses it (vLLM's layout). The first layer gets residual None."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = add_rms_norm(x, residual, self.input_layernorm)
        h = self.self_attn(h, cos, sin, kv_cache, attn)
        h, residual = add_rms_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(h), residual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), one kernel on CUDA."""
    return norm.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
