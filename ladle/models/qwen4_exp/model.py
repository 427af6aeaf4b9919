"""Qwen4-Exp's text model (HF's Qwen4ExpForCausalLM, and the text of Qwen4ExpForConditionalGeneration): Gated
DeltaNet layers ("linear_attention") between QSA indexed-attention layers ("indexed_attention"), every layer's
MLP routed experts plus a gated shared expert, the residual as hc_count hyper-connected streams, and PLE
(hashed n-gram embeddings and a dilated short convolution) on the layers in ple_layer_ids.

Caches, per layer: an indexed layer's K/V paged as full attention; a linear layer's state slot (Gated DeltaNet's
conv inputs and recurrent state, and on a PLE layer also PLE's conv inputs and n-gram context). After the model's
own layers, one cache layer per indexed layer holds its indexer's raw keys, a KV cache group of their own
(ladle.models.qwen4_exp.indexed_attention.indexer_key_spec).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ladle.attention.backend import BackendMetadata
from ladle.attention.metadata import StateMetadata
from ladle.experts.backing import TensorLocation
from ladle.kv_cache.specs import AttentionSpec, CacheSpec, StateSpec, layer_groups
from ladle.models.decoder import DecoderForCausalLM, TextModel
from ladle.models.layers.decoder_layer import RotaryEmbedding, head_dim_of
from ladle.models.layers.gated_deltanet import GatedDeltaNet, state_spec
from ladle.models.layers.moe import SharedExpertMoeBlock
from ladle.models.qwen4_exp.config import check_config
from ladle.models.qwen4_exp.hyper_connection import GatedResidual
from ladle.models.qwen4_exp.indexed_attention import IndexedAttention, indexer_key_spec
from ladle.models.qwen4_exp.norms import ActivationGatedRMSNorm
from ladle.models.qwen4_exp.ple import PleLayer, ple_state_shapes

logger = logging.getLogger("ladle")

_SHARD = re.compile(r"^(.*\.ngram_embedding)\.shard_(\d+)\.weight$")
# Buffers HF saves that ladle derives from the config (ladle.models.qwen4_exp.ngram_hash); checked on load.
_HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class Qwen4ExpGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet whose output gate is the config's output_gate_type (silu or sigmoid; hidden_act if unset)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.norm = ActivationGatedRMSNorm(self.head_v_dim, config.rms_norm_eps,
                                           config.output_gate_type or config.hidden_act)


class Qwen4ExpLayer(nn.Module):
    def __init__(self, config: Any, layer_type: str, ple_index: int | None) -> None:
        super().__init__()
        linear = layer_type == "linear_attention"
        self.linear_attn = Qwen4ExpGatedDeltaNet(config) if linear else None
        self.self_attn = None if linear else IndexedAttention(config)
        self.mlp = SharedExpertMoeBlock(config)
        self.ple = None if ple_index is None else PleLayer(config, ple_index)
        self.attn_hyper_connection = GatedResidual(config)
        self.mlp_hyper_connection = GatedResidual(config)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: BackendMetadata | StateMetadata,
                index_cache: tuple[torch.Tensor, ...], index_meta: BackendMetadata | StateMetadata | None,
                rope: RotaryEmbedding, ple: torch.Tensor | None) -> torch.Tensor:
        """ple: the step's n-gram embeddings, staged by the model (PLE layers only)."""
        if self.ple is not None:
            assert isinstance(meta, StateMetadata) and ple is not None
            streams = streams + self.ple.mix(streams, ple, cache[2:], meta)
        h, weights = self.attn_hyper_connection.mix(streams)
        if self.linear_attn is not None:
            assert isinstance(meta, StateMetadata)
            h = self.linear_attn(h, cache[:2], meta)
        else:
            assert self.self_attn is not None and isinstance(meta, BackendMetadata)
            assert isinstance(index_meta, BackendMetadata)
            h = self.self_attn(h, positions, cos, sin, cache, index_cache, meta, index_meta, rope)
        assert weights is not None  # the layers' hyper-connections inject
        streams = GatedResidual.inject(streams, h, weights)
        h, weights = self.mlp_hyper_connection.mix(streams)
        assert weights is not None
        return GatedResidual.inject(streams, self.mlp(h), weights)


def cache_specs(config: Any, dtype: torch.dtype) -> list[CacheSpec]:
    """Each layer's cache, then the indexer keys of each indexed layer (see the module docstring)."""
    attention = AttentionSpec(config.num_key_value_heads, head_dim_of(config), dtype)
    gdn = state_spec(config, dtype)
    conv, context = ple_state_shapes(config)
    ple = StateSpec(gdn.shapes + (conv, context), gdn.dtypes + (dtype, torch.int64), "gated deltanet + PLE state")
    ple_layers = set(config.ple_layer_ids or [])
    specs: list[CacheSpec] = [attention if kind == "indexed_attention" else ple if i + 1 in ple_layers else gdn
                              for i, kind in enumerate(config.layer_types)]
    return specs + [indexer_key_spec(config, dtype)] * config.layer_types.count("indexed_attention")


class Qwen4ExpModel(TextModel):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.hc_count = config.hc_count
        self.layer_group = layer_groups(cache_specs(config, torch.float32))
        n = config.num_hidden_layers
        indexed = [i for i, kind in enumerate(config.layer_types) if kind == "indexed_attention"]
        self.index_layer = {layer: n + j for j, layer in enumerate(indexed)}
        ple = list(config.ple_layer_ids or [])
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(Qwen4ExpLayer(config, kind, ple.index(i + 1) if i + 1 in ple else None)
                                    for i, kind in enumerate(config.layer_types))
        self.rotary_emb = RotaryEmbedding(config)
        self.hyper_connection_mixer = GatedResidual(config, inject=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple[torch.Tensor, ...]],
                meta: tuple[BackendMetadata | StateMetadata, ...]) -> torch.Tensor:
        """-> the final mixer's output [T, hidden] (the head's input; Qwen4-Exp has no final norm after it)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        streams = x.repeat(1, self.hc_count)
        staged = {}
        for i, layer in enumerate(self.layers):  # every PLE table's rows, before the first layer (PleLayer.stage)
            ple, state = layer.ple, meta[self.layer_group[i]]
            if isinstance(ple, PleLayer):
                assert isinstance(state, StateMetadata)
                staged[i] = ple.stage(input_ids, caches[i][2:], state)
        for i, layer in enumerate(self.layers):
            index = self.index_layer.get(i)
            streams = layer(streams, positions, cos, sin, caches[i], meta[self.layer_group[i]],
                            () if index is None else caches[index], None if index is None else
                            meta[self.layer_group[index]], self.rotary_emb, staged.get(i))
        return self.hyper_connection_mixer.mix(streams)[0]


class Qwen4ExpForCausalLM(DecoderForCausalLM):
    """HF's Qwen4ExpForCausalLM; the registry also hands it the text_config of Qwen4ExpForConditionalGeneration
    checkpoints, whose vision tower is not loaded (said at load)."""

    tensor_parallel = False  # no sharded form of its indexed attention, PLE or hyper-connections yet

    def build_model(self, config: Any) -> TextModel:
        check_config(config)
        return Qwen4ExpModel(config)

    def cache_specs(self, dtype: torch.dtype, max_model_len: int | None = None) -> list[CacheSpec]:
        return cache_specs(self.config, dtype)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF's names; an image-text checkpoint's `model.language_model.*` as `model.*`, its vision tower
        (`model.visual.*`) and any multi-token-prediction layer (`mtp.*`) left out and said so; PLE tables as
        HF's split_ngram_parts shards (`ngram_embedding.shard_J.weight`, J-th torch.chunk of the rows)."""
        params = dict(self.named_parameters())
        rows_filled: dict[str, int] = {}
        skipped: dict[str, int] = {}

        def kept() -> Iterator[tuple[str, torch.Tensor]]:
            for raw, tensor in weights:
                if raw.startswith(("model.visual.", "mtp.")):
                    key = "the vision tower (model.visual.*)" if raw.startswith("model.visual.") else \
                        "the multi-token-prediction layer (mtp.*)"
                    skipped[key] = skipped.get(key, 0) + 1
                    continue
                name = "model." + raw.removeprefix("model.language_model.") if raw.startswith(
                    "model.language_model.") else raw
                if name.rsplit(".", 1)[-1] in _HASH_BUFFERS:
                    self._check_hash_buffer(name, tensor)
                    continue
                shard = _SHARD.match(name)
                if shard:
                    self._copy_shard(params, shard.group(1) + ".weight", int(shard.group(2)), tensor, rows_filled)
                    continue
                yield name, tensor

        loaded = super().load_weights(kept())
        for what, count in skipped.items():
            logger.info("%s: %s is not loaded (%d tensors); ladle serves the text model only",
                        type(self).__name__, what, count)
        return loaded | {name for name, rows in rows_filled.items() if rows == params[name].shape[0]}

    def table_sources(self, locations: dict[str, TensorLocation],
                      renames: dict[str, str]) -> dict[str, list[tuple[int, str, TensorLocation]]]:
        """The checkpoint tensors holding each PLE table's rows (ple_table mmap: ladle.models.loading.mapped_tables),
        named as load_weights reads them: whole, or as split_ngram_parts shards (shard J from row J x ceil(rows /
        parts))."""
        params = dict(self.named_parameters())
        out: dict[str, list[tuple[int, str, TensorLocation]]] = {}
        for raw, loc in locations.items():
            name = renames.get(raw, raw)
            if name.startswith("model.language_model."):
                name = "model." + name.removeprefix("model.language_model.")
            shard = _SHARD.match(name)
            if shard:
                param = shard.group(1) + ".weight"
                if param in params:
                    step = -(-params[param].shape[0] // self.config.split_ngram_parts)
                    out.setdefault(param, []).append((int(shard.group(2)) * step, raw, loc))
            elif name.endswith(".ngram_embedding.weight") and name in params:
                out.setdefault(name, []).append((0, raw, loc))
        return out

    def _copy_shard(self, params: dict[str, nn.Parameter], name: str, index: int, tensor: torch.Tensor,
                    rows_filled: dict[str, int]) -> None:
        if name not in params:
            raise ValueError(f"checkpoint PLE shard of {name!r} matches no parameter of {type(self).__name__}")
        dest, parts = params[name], self.config.split_ngram_parts
        step = -(-dest.shape[0] // parts)
        start = index * step
        if start + tensor.shape[0] > dest.shape[0] or tensor.shape[1:] != dest.shape[1:] or (
                tensor.shape[0] != min(step, dest.shape[0] - start)):
            raise ValueError(f"{name} shard {index}: shape {tuple(tensor.shape)} is not chunk {index} of "
                             f"{parts} of {tuple(dest.shape)}")
        dest[start:start + tensor.shape[0]].copy_(tensor)
        rows_filled[name] = rows_filled.get(name, 0) + tensor.shape[0]

    def _check_hash_buffer(self, name: str, tensor: torch.Tensor) -> None:
        """The checkpoint's hash parameters must be the ones ladle derives from the config."""
        layer = self.model.layers[int(name.split(".")[2])]
        ple = getattr(layer, "ple", None)
        if not isinstance(ple, PleLayer):
            raise ValueError(f"checkpoint tensor {name!r}: layer has no PLE in this config")
        h = ple.ple_embedding.hash
        want = {"layer_multipliers": h.multipliers, "ngram_heads_vocab_sizes": h.sizes,
                "ngram_heads_offsets": h.offsets}[name.rsplit(".", 1)[-1]]
        if tensor.tolist() != want:
            raise ValueError(f"{name} is {tensor.tolist()}, not {want} as the config's n-gram fields derive")
