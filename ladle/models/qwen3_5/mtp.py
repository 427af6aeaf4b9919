"""Qwen3.5's multi-token-prediction layer (`mtp.*` in its checkpoints), the drafter of speculative decoding's
`mtp` method.

At position i it reads the target's final-normed hidden state h_i and the token at i + 1, and predicts the token
at i + 2: fc(cat(norm_e(embed(t_{i+1})), norm_h(h_i))), one full-attention decoder layer of the model's own kind
(with its own KV cache, the last cache layer, in the target's attention group), then a final norm; the target's
embedding and head are shared. Its output, fed back as the hidden state with its own draft as the token, gives
the next draft (vLLM's qwen3_5_mtp does the same).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn

from ladle.attention.backend import BackendMetadata


def num_mtp_layers(config: Any) -> int:
    """The checkpoint's MTP layers (config.mtp_num_hidden_layers, as Qwen3.5's config.json names them)."""
    return int(getattr(config, "mtp_num_hidden_layers", 0) or 0)


def check_mtp_layers(config: Any) -> None:
    n = num_mtp_layers(config)
    if n != 1:
        raise ValueError(f"speculative_config method 'mtp' needs a checkpoint with one MTP layer "
                         f"(mtp_num_hidden_layers = 1 in its config); this one has {n}")


class KvWriter(Protocol):
    def write_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                 attn: BackendMetadata) -> None: ...


class AttentionLayer(Protocol):
    """What write_kv reads of the layer: Qwen3.5's HybridLayer with full attention (said by its shape, as
    ladle.models.qwen3_5.model imports this file)."""

    @property
    def input_layernorm(self) -> nn.Module: ...

    @property
    def self_attn(self) -> KvWriter: ...


class MultiTokenPredictor(nn.Module):
    def __init__(self, hidden_size: int, layer: nn.Module, make_norm: Callable[[], nn.Module]) -> None:
        """layer: the decoder layer (full attention, the model's MLP kind); make_norm: the model's RMSNorm."""
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = make_norm()
        self.pre_fc_norm_hidden = make_norm()
        self.layers = nn.ModuleList([layer])
        self.norm = make_norm()

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata) -> torch.Tensor:
        """embeds [T, H]: the embedded next tokens; hidden [T, H]: the target's (or this layer's own) normed
        output at each position -> this layer's normed output [T, H], whose logits are the drafts'."""
        x = self.layers[0](self._input(embeds, hidden), cos, sin, kv_cache, attn)
        return self.norm(x)

    def write_kv(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata) -> None:
        """Only the layer's K/V at these positions: a fraction of the layer (no queries, attention or MLP)."""
        layer = cast(AttentionLayer, self.layers[0])  # the full-attention layer enable_mtp builds it with
        layer.self_attn.write_kv(layer.input_layernorm(self._input(embeds, hidden)), cos, sin, kv_cache, attn)

    def _input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
