"""PLE, per-layer embeddings (HF's Qwen4ExpTextPLELayer): each token's hashed n-gram embedding (ngram_hash) is
projected to a value and to one key per hyper-connection stream; each stream's normed activations gate the value
(a signed square root of their dot product through a sigmoid), and a dilated depthwise convolution over the
normed gated values (kernel ple_conv_kernel_size, dilation ngram_size) adds local context. The result is added
to the streams before the layer's mixer.

Per request and layer, the state slot carries across prefill chunks what a chunk needs of the tokens before it:
the n-gram context (the last ngram_size - 1 token ids, int64) and the convolution's last
(kernel - 1) x dilation inputs. A first chunk starts from EOS ids and zeros, as HF does. With speculative decoding
both are also kept after each of a row's first tokens (StateMetadata.draft_rows), as Gated DeltaNet keeps its own,
so a rejected draft rolls the whole slot back.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ladle.attention.metadata import StateMetadata
from ladle.models.layers.host_table import HostTable
from ladle.models.qwen4_exp.ngram_hash import NGramHash
from ladle.models.qwen4_exp.norms import GroupedRMSNorm


def ple_state_shapes(config: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the convolution's previous inputs [hc_count * hidden, (kernel - 1) * ngram_size], the n-gram context
    [ngram_size - 1])."""
    width = config.hc_count * config.hidden_size
    return (width, (config.ple_conv_kernel_size - 1) * config.ngram_size), (config.ngram_size - 1,)


class NGramEmbedding(nn.Module):
    """The table, named as HF names it (`ple_embedding.ngram_embedding.weight`): rows of all heads' tables
    concatenated (padded to make_ngram_vocab_size_divisible_by), ple_embed_dim / heads wide; on the device or
    held in host memory (HostTable)."""

    def __init__(self, config: Any, ple_index: int) -> None:
        super().__init__()
        self.hash = NGramHash(config, ple_index)
        heads = (config.ngram_size - 1) * config.heads_per_ngram
        weight = torch.empty(self.hash.padded_rows, config.ple_embed_dim // heads)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.ngram_embedding = HostTable(weight)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """Token windows [T, ngram_size] -> [T, ple_embed_dim]."""
        return self.ngram_embedding(self.hash.rows(windows)).flatten(-2)


class PleLayer(nn.Module):
    def __init__(self, config: Any, ple_index: int) -> None:
        super().__init__()
        self.n, self.hidden = config.hc_count, config.hidden_size
        width, dim = self.n * self.hidden, config.ple_embed_dim
        self.ple_embedding = NGramEmbedding(config, ple_index)
        self.dilation = config.ngram_size
        self.state_len = (config.ple_conv_kernel_size - 1) * self.dilation
        self.key_proj = nn.Linear(dim, width, bias=False)
        self.value_proj = nn.Linear(dim, self.hidden, bias=False)
        eps = config.rms_norm_eps
        self.norm_key = GroupedRMSNorm(width, eps, self.hidden)
        self.norm_query = GroupedRMSNorm(width, eps, self.hidden)
        self.norm_conv = GroupedRMSNorm(width, eps, self.hidden)
        self.conv1d = nn.Conv1d(width, width, config.ple_conv_kernel_size, groups=width, dilation=self.dilation,
                                bias=False)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, state: tuple[torch.Tensor, ...],
                meta: StateMetadata) -> torch.Tensor:
        """streams [T, n * H], the step's token ids [T]; state: (conv inputs [slots, n * H, S], n-gram context
        [slots, ngram_size - 1]) -> what PLE adds to the streams [T, n * H]."""
        return self.mix(streams, self.stage(input_ids, state, meta), state, meta)

    def stage(self, input_ids: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        """The step's n-gram embeddings [T, ple_embed_dim], which depend on the token ids alone: the model stages
        every PLE layer's before its first layer runs, so a table held in host memory is read ahead of the layer.
        Moves the n-gram context in the state slot on."""
        return self.ple_embedding(self._windows(input_ids, state[1], meta))

    def mix(self, streams: torch.Tensor, emb: torch.Tensor, state: tuple[torch.Tensor, ...],
            meta: StateMetadata) -> torch.Tensor:
        """What PLE adds to the streams, given the step's staged embeddings."""
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.n, self.hidden))
        value = self.value_proj(emb)
        query = self.norm_query(streams).unflatten(-1, (self.n, self.hidden))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
        return gated + self._short_conv(self.norm_conv(gated), state[0], meta)

    def _windows(self, input_ids: torch.Tensor, context: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """Each new token's n-gram window [T, ngram_size]; each request's context moves on to its last tokens."""
        cu, eos, k = meta.cu_seqlens_host, self.ple_embedding.hash.eos, self.ple_embedding.hash.context_len
        parts = []
        for i, slot in enumerate(meta.slots_host):
            prev = context[slot] if meta.has_initial_state[i] else context.new_full((k,), eos)
            history = torch.cat((prev, input_ids[cu[i]:cu[i + 1]].to(torch.long)))
            parts.append(history.unfold(0, k + 1, 1))
            context[slot] = history[history.shape[0] - k:]
            for j, row in enumerate(_kept(meta, i)):  # the context after each of its first tokens, for a rollback
                context[row] = history[j + 1 : j + 1 + k]
        return torch.cat(parts)

    def _short_conv(self, x: torch.Tensor, conv_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """silu(dilated depthwise conv) of x [T, C] over each request's rows, its previous S inputs from
        conv_state (zeros for a first chunk), which then keeps the last S."""
        out = torch.empty_like(x)
        cu, c, s = meta.cu_seqlens_host, x.shape[1], self.state_len
        for i, slot in enumerate(meta.slots_host):
            rows = x[cu[i]:cu[i + 1]].t()
            prev = conv_state[slot] if meta.has_initial_state[i] else rows.new_zeros(c, s)
            full = torch.cat((prev.to(rows.dtype), rows), dim=-1)
            y = F.conv1d(full[None], self.conv1d.weight, groups=c, dilation=self.dilation)[0]
            out[cu[i]:cu[i + 1]] = F.silu(y).t()
            conv_state[slot] = full[:, full.shape[1] - s:]
            for j, row in enumerate(_kept(meta, i)):
                conv_state[row] = full[:, j + 1 : j + 1 + s]
        return out


def _kept(meta: StateMetadata, i: int) -> tuple[int, ...]:
    """Speculative decoding: the state rows that keep request i's state after each of its first new tokens (the
    runner rolls a rejected draft back to one of them); none without drafts."""
    return () if meta.draft_rows is None else meta.draft_rows[i]
