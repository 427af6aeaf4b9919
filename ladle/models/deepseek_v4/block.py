"""DeepSeek-V4's decoder block: attention and MoE, each between a mix of the hyper-connected residual streams
(hyper_weights) and their merge back; and the collapse of the streams into one hidden state (hyper_head)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ladle.attention.backend import BackendMetadata
from ladle.models.deepseek_v4.attention import CompressedCaches, Dsv4Attention
from ladle.models.deepseek_v4.compressor import Dsv4RMSNorm, unweighted_rms_norm
from ladle.models.deepseek_v4.moe import MoE


def hyper_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int,
                  iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, H] -> (post [T, n], comb [T, n, n], the streams collapsed by pre [T, H]), all weights
    from one projection of the normed streams, in fp32; comb is made doubly stochastic by Sinkhorn."""
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), norm_eps)
    pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hyper_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
               norm_eps: float) -> torch.Tensor:
    """streams [T, n, H] collapsed to [T, H] by weights from the normed streams (the model's, or its MTP
    layer's, hc_head), in fp32."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class Block(nn.Module):
    # the hyper-connection mixes' parameters, set by name in __init__
    hc_attn_fn: nn.Parameter
    hc_attn_base: nn.Parameter
    hc_attn_scale: nn.Parameter
    hc_ffn_fn: nn.Parameter
    hc_ffn_base: nn.Parameter
    hc_ffn_scale: nn.Parameter

    def __init__(self, config: Any, layer_type: str, mlp_type: str) -> None:
        super().__init__()
        h, n = config.hidden_size, config.hc_mult
        self.attn = Dsv4Attention(config, layer_type)
        self.ffn = MoE(config, mlp_type == "hash_moe")
        self.attn_norm, self.ffn_norm = Dsv4RMSNorm(h, config.rms_norm_eps), Dsv4RMSNorm(h, config.rms_norm_eps)
        mix = (2 + n) * n
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.empty(mix, n * h)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.ones(3)))
        self.hc = (n, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)

    def _mixed(self, part: str, streams: torch.Tensor, block: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        post, comb, collapsed = hyper_weights(streams, getattr(self, f"hc_{part}_fn"),
                                              getattr(self, f"hc_{part}_base"), getattr(self, f"hc_{part}_scale"),
                                              *self.hc)
        out = block(collapsed)
        dtype = streams.dtype
        # comb mixes the input streams transposed: output stream k gets sum_j comb[j, k] * stream j.
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                               streams)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, rope: Any,
                kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata,
                compressed: CompressedCaches | None) -> torch.Tensor:
        streams = self._mixed("attn", streams, lambda h: self.attn(self.attn_norm(h), positions, rope, kv_cache,
                                                                   attn, compressed))
        return self._mixed("ffn", streams, lambda h: self.ffn(self.ffn_norm(h), input_ids))
