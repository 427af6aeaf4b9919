"""Qwen3.5 text models (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM): Gated DeltaNet layers with a state
per request, interleaved with full-attention layers whose output is gated and whose rope is partial.

Norms are zero-centred (the weight is stored as w - 1). The full-attention layers' q_proj also yields a
per-head output gate: its rows are, per head, head_dim query rows then head_dim gate rows.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ladle.attention.backend import BackendMetadata
from ladle.attention.metadata import StateMetadata
from ladle.kernels.cpu_kernels import load as load_cpu_kernels
from ladle.kv_cache.specs import AttentionSpec, CacheSpec, layer_groups
from ladle.models.decoder import DecoderForCausalLM, MlpFactory, TextModel
from ladle.models.layers.cpu_linear import pack_linears, use_cpu_linears
from ladle.models.layers.decoder_layer import RotaryEmbedding, StackedLinear, head_dim_of
from ladle.models.layers.gated_deltanet import GatedDeltaNet, state_spec
from ladle.models.layers.moe import SharedExpertMoeBlock
from ladle.models.layers.ops import apply_rotary
from ladle.models.qwen3_5.mtp import MultiTokenPredictor, check_mtp_layers

_LAYER_TYPES = ("linear_attention", "full_attention")


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), all in fp32, cast back at the end (HF's Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(nn.Module):
    """GQA over the paged KV cache with q/k norm, partial rope and a sigmoid gate on the output."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = (2 * q_size, kv_size, kv_size)
        self.qkv_proj = StackedLinear(config.hidden_size, dict(zip(("q_proj", "k_proj", "v_proj"), self.sizes)),
                                      bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata) -> torch.Tensor:
        t = x.shape[0]
        q_gate, k, v = self._qkv(x, cos, sin)
        q, gate = q_gate.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = _partial_rope(self.q_norm(q), cos, sin)
        o = attn.backend(q.contiguous(), k, v, kv_cache[0], kv_cache[1], attn, self.scale)
        o = o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o)


    def write_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                 attn: BackendMetadata) -> None:
        """Only these positions' K/V into the cache: what a later query reads of them."""
        _, k, v = self._qkv(x, cos, sin)
        attn.backend.write_kv(k, v, kv_cache[0], kv_cache[1], attn)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the query and gate rows, roped and normed K [T, kv heads, head dim], V likewise)."""
        t = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        k = _partial_rope(self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        return q_gate, k.contiguous(), v.view(t, self.num_kv_heads, self.head_dim)


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


class HybridLayer(nn.Module):
    """Pre-norm residual block whose mixer is Gated DeltaNet or gated attention, as layer_types says."""

    def __init__(self, config: Any, layer_type: str, mlp: nn.Module) -> None:
        super().__init__()
        self.linear_attn = GatedDeltaNet(config) if layer_type == "linear_attention" else None
        self.self_attn = GatedAttention(config) if layer_type == "full_attention" else None
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: tuple[torch.Tensor, ...],
                meta: BackendMetadata | StateMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            assert isinstance(meta, StateMetadata)
            h = self.linear_attn(h, cache, meta)
        else:
            assert self.self_attn is not None and isinstance(meta, BackendMetadata)
            h = self.self_attn(h, cos, sin, cache, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridModel(TextModel):
    def __init__(self, config: Any, specs: list[CacheSpec], make_mlp: MlpFactory) -> None:
        super().__init__()
        self.layer_group = layer_groups(specs)
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(HybridLayer(config, kind, make_mlp(config, i))
                                    for i, kind in enumerate(config.layer_types))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple[torch.Tensor, ...]],
                meta: tuple[BackendMetadata | StateMetadata, ...]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer, cache, group in zip(self.layers, caches, self.layer_group):
            x = layer(x, cos, sin, cache, meta[group])
        return self.norm(x)


def text_weights(weights: Iterable[tuple[str, torch.Tensor]],
                 mtp: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors of a checkpoint, as HF's Qwen3_5ForCausalLM reads them: an image-text
    checkpoint's `model.language_model.*` as `model.*`; the vision tower (`model.visual.*`) left out, and the
    multi-token-prediction layer (`mtp.*`) unless it drafts (mtp)."""
    for name, tensor in weights:
        if name.startswith("model.visual.") or (name.startswith("mtp.") and not mtp):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        yield name, tensor


def _layer_specs(config: Any, dtype: torch.dtype) -> list[CacheSpec]:
    return [AttentionSpec(config.num_key_value_heads, head_dim_of(config), dtype) if kind == "full_attention"
            else state_spec(config, dtype) for kind in config.layer_types]


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """HF's Qwen3_5ForCausalLM (text only), also serving the text of Qwen3_5ForConditionalGeneration
    checkpoints (the registry hands it their text_config). With enable_mtp(), its MTP layer drafts too."""

    tensor_parallel = False  # its Gated DeltaNet and gated attention layers have no sharded form yet
    supports_mtp = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.mtp: MultiTokenPredictor | None = None  # (an instance attribute: a class one would hide the module)

    def enable_mtp(self) -> None:
        """Build the MTP layer (before loading): its weights load with the model's, its KV cache is the last
        cache layer (cache_specs)."""
        config = self.config
        check_mtp_layers(config)
        layer = HybridLayer(config, "full_attention", self.make_mlp(config, len(config.layer_types)))
        self.mtp = MultiTokenPredictor(config.hidden_size, layer,
                                       lambda: ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps))

    def mtp_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata,
                    write_only: bool = False) -> torch.Tensor | None:
        """The MTP layer at these positions: next_ids [T] the token after each, hidden [T, H] the normed state
        there (the target's, or the MTP layer's own when it drafts on) -> its normed output [T, H]; write_only:
        only its K/V into the cache, for later positions to read (None)."""
        assert self.mtp is not None, "enable_mtp() first"
        embeds = self.model.embed_tokens(next_ids)
        cos, sin = self.model.rotary_emb(positions, embeds.dtype)
        if write_only:
            self.mtp.write_kv(embeds, hidden, cos, sin, kv_cache, attn)
            return None
        return self.mtp(embeds, hidden, cos, sin, kv_cache, attn)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The MTP layer's (normed) output -> logits, through the model's head."""
        return self.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(text_weights(weights, self.mtp is not None))

    def lay_out_for_cpu(self) -> None:
        """The MTP layer's linears as the model's own (ladle.models.layers.cpu_linear)."""
        super().lay_out_for_cpu()
        if self.mtp is None or self.cpu_kernels is None:
            return
        kind = self.cpu_kernels[0]
        if kind == "ladle-c":
            use_cpu_linears(self.mtp, load_cpu_kernels())
        elif kind == "onednn":
            pack_linears(self.mtp)

    def build_model(self, config: Any) -> TextModel:
        unknown = sorted(set(config.layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported; supported: {', '.join(_LAYER_TYPES)}")
        return HybridModel(config, _layer_specs(config, torch.float32), self.make_mlp)

    def cache_specs(self, dtype: torch.dtype, max_model_len: int | None = None) -> list[CacheSpec]:
        """The layers' caches, then the MTP layer's (a full-attention layer's) when it drafts."""
        config = self.config
        mtp = [AttentionSpec(config.num_key_value_heads, head_dim_of(config), dtype)] if self.mtp is not None else []
        return _layer_specs(config, dtype) + mtp


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's MLP is routed experts plus a gated shared expert."""

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return SharedExpertMoeBlock(config)
