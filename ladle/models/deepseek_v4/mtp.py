"""DeepSeek-V4's multi-token-prediction layer (`mtp.0.*` in its checkpoints), the drafter of speculative
decoding's `mtp` method, as DeepSeek's reference runs it (inference/model.py, MTPBlock).

At position i it reads the target's hyper-connected streams there (before their collapse) and the token at
i + 1: streams = h_proj(hnorm(streams)) + e_proj(enorm(embed(t_{i+1}))), each stream normed and projected on
its own and the token added to every one; then a decoder block of the model's own kind (sliding-window attention,
score-routed MoE; its window's K=V the last cache layer, in the model's window group); its logits are those of
its own collapse (hc_head) and norm through the shared head. Its output streams, fed back with its own draft as
the token, give the next draft.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ladle.attention.backend import BackendMetadata
from ladle.models.deepseek_v4.block import Block, hyper_head, hyper_weights
from ladle.models.deepseek_v4.compressor import Dsv4RMSNorm


def check_mtp_layers(config: Any) -> None:
    n = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if n != 1:
        raise ValueError(f"speculative_config method 'mtp' needs a checkpoint with one MTP layer "
                         f"(num_nextn_predict_layers = 1 in its config); this one has {n}")


class Dsv4MultiTokenPredictor(Block):
    def __init__(self, config: Any) -> None:
        super().__init__(config, "sliding_attention", "moe")
        h, n, eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm, self.hnorm, self.norm = Dsv4RMSNorm(h, eps), Dsv4RMSNorm(h, eps), Dsv4RMSNorm(h, eps)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * h))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.shape, self.eps = (n, h), (config.hc_eps, eps)

    def _streams(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        streams = hidden.view(hidden.shape[0], *self.shape)
        return self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(1)

    def run(self, embeds: torch.Tensor, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
            rope: Any, kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata) -> torch.Tensor:
        """embeds [T, H] of the next tokens (input_ids), hidden [T, n * H] the streams there -> its output
        streams [T, n * H]."""
        return self(self._streams(embeds, hidden), input_ids, positions, rope, kv_cache, attn, None).flatten(1)

    def write_kv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rope: Any,
                 kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata) -> None:
        """Only the block's window K=V at these positions (its attention input; no query, attention or MoE)."""
        _, _, collapsed = hyper_weights(self._streams(embeds, hidden), self.hc_attn_fn, self.hc_attn_base,
                                        self.hc_attn_scale, *self.hc)
        self.attn.write_kv(self.attn_norm(collapsed), positions, rope, kv_cache, attn)

    def collapse(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output streams [N, n * H] -> the normed hidden state [N, H] its logits come from."""
        streams = hidden.view(hidden.shape[0], *self.shape)
        return self.norm(hyper_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, *self.eps))
