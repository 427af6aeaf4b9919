"""DeepSeek-V4 (DeepseekV4ForCausalLM): hyper-connected residual streams around sliding-window, compressed-
sparse and heavily-compressed attention layers, and MoE layers routed by score or by a token-id hash.

Parameters carry the checkpoint's own names (`layers.N.attn.wq_a`, `layers.N.ffn.experts.J.w1`, `hc_head_fn`,
...), which is how HF transformers saves this model too (it renames on load).

Caches, per layer: the sliding window's K=V vectors in the paged pool (one tensor, kv_shared); and for a
compressed layer its entries (one per compress_rate tokens) and, CSA, the indexer's keys, each a paged group
of its own, plus a state slot with its compressors' pending projections (ladle.models.deepseek_v4.compressor).
These are cache layers after the model's own: the entries of every compressed layer, then the indexer keys of
every CSA layer, then the state of every compressed layer.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ladle.attention.backend import BackendMetadata
from ladle.attention.metadata import StateMetadata
from ladle.kernels.cpu_kernels import KernelUnavailable
from ladle.kernels.cpu_kernels import load as load_cpu_kernels
from ladle.kv_cache.specs import AttentionSpec, CacheSpec, StateSpec, layer_groups
from ladle.models.decoder import copy_checkpoint
from ladle.models.deepseek_v4.attention import LAYER_TYPES, CompressedCaches, Dsv4Rope
from ladle.models.deepseek_v4.block import Block, hyper_head
from ladle.models.deepseek_v4.compressor import Dsv4RMSNorm
from ladle.models.deepseek_v4.mtp import Dsv4MultiTokenPredictor, check_mtp_layers
from ladle.models.interface import ConfiguredModel
from ladle.models.layers.cpu_linear import pack
from ladle.models.layers.moe import FusedMoE
from ladle.quantization.fp8_linear import Fp8Linear, WidenBuffer

_RENAMES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "hc_head.hc_fn": "hc_head_fn",
            "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}


class DeepseekV4ForCausalLM(ConfiguredModel):
    tensor_parallel: ClassVar[bool] = False  # no sharded form of its attention, compressors or hyper-connections
    cpu_kernels: tuple[str, str] | None = None  # torch's kernels, but for quantized layers (lay_out_for_cpu)
    supports_mtp: ClassVar[bool] = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        _check_config(config)
        self.config = config
        h, n = config.hidden_size, config.hc_mult
        weight = torch.empty(config.vocab_size, h)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed = nn.Embedding(config.vocab_size, h, _weight=weight)
        self.layers = nn.ModuleList(Block(config, config.layer_types[i], config.mlp_layer_types[i])
                                    for i in range(config.num_hidden_layers))
        self.norm = Dsv4RMSNorm(h, config.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * h))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.head = None if self.tie_word_embeddings else nn.Linear(h, config.vocab_size, bias=False)
        self.ropes = nn.ModuleDict({kind: Dsv4Rope(config, kind) for kind in ("main", "compress")})
        self.compressed = [i for i, kind in enumerate(config.layer_types) if kind != "sliding_attention"]
        csa = [i for i in self.compressed if config.layer_types[i] == "compressed_sparse_attention"]
        # Cache layer of each compressed layer's entries, indexer keys and state (see the module docstring).
        n = config.num_hidden_layers
        self.entries_layer = {layer: n + j for j, layer in enumerate(self.compressed)}
        self.index_layer = {layer: n + len(self.compressed) + j for j, layer in enumerate(csa)}
        self.state_layer = {layer: n + len(self.compressed) + len(csa) + j for j, layer in enumerate(self.compressed)}
        self.mtp: Dsv4MultiTokenPredictor | None = None
        self.layer_group = layer_groups(self.cache_specs(torch.float32))

    def enable_mtp(self) -> None:
        """Build the MTP layer (before loading): its weights load with the model's (`mtp.0.*`), its window is the
        last cache layer (cache_specs)."""
        check_mtp_layers(self.config)
        self.mtp = Dsv4MultiTokenPredictor(self.config)

    def mtp_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata,
                    write_only: bool = False) -> torch.Tensor | None:
        """The MTP layer at these positions: next_ids [T] the token after each, hidden [T, n * H] the streams
        there (the model's, or the MTP layer's own when it drafts on) -> its output streams; write_only: only its
        window K=V, for later positions to read (None)."""
        assert self.mtp is not None, "enable_mtp() first"
        embeds, rope = self.embed(next_ids), self.ropes["main"]
        if write_only:
            self.mtp.write_kv(embeds, hidden, positions, rope, kv_cache, attn)
            return None
        return self.mtp.run(embeds, hidden, next_ids, positions, rope, kv_cache, attn)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's output streams -> logits: its own collapse and norm, the model's head."""
        assert self.mtp is not None
        return self.head_logits(self.mtp.collapse(hidden))

    def cache_specs(self, dtype: torch.dtype, max_model_len: int | None = None) -> list[CacheSpec]:
        """Per layer its window's K=V vectors; per compressed layer its entries (and indexer keys), paged by
        entry position; per compressed layer a state slot for the groups not complete yet. Nothing depends on
        max_model_len: the entries grow in blocks like any KV."""
        config = self.config
        d = config.head_dim
        window = AttentionSpec(1, d, dtype, config.sliding_window, kv_shared=True)
        specs: list[CacheSpec] = [window] * config.num_hidden_layers
        for i in self.compressed:
            specs.append(AttentionSpec(1, d, dtype, None, kv_shared=True,
                                       compress_rate=config.compress_rates[config.layer_types[i]]))
        for i in self.index_layer:
            specs.append(AttentionSpec(1, config.index_head_dim, dtype, None, kv_shared=True,
                                       compress_rate=config.compress_rates[config.layer_types[i]],
                                       block_scale=d // config.index_head_dim))
        for i in self.compressed:
            block = self.layers[i]
            assert isinstance(block, Block)  # the layers are Blocks
            shapes = tuple(block.attn.state_shapes())
            specs.append(StateSpec(shapes, (dtype,) * len(shapes), f"{config.layer_types[i]} compressor state"))
        return specs + ([window] if self.mtp is not None else [])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple[torch.Tensor, ...]],
                meta: tuple[BackendMetadata | StateMetadata, ...]) -> torch.Tensor:
        """-> the hyper-connected streams, flattened [T, n * H]: compute_logits collapses the rows it needs, and
        the MTP layer reads them whole."""
        config = self.config
        x = self.embed(input_ids)
        streams = x.unsqueeze(1).expand(-1, config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            attn = meta[self.layer_group[i]]
            assert isinstance(attn, BackendMetadata)
            rope = self.ropes["main" if config.layer_types[i] == "sliding_attention" else "compress"]
            streams = layer(streams, input_ids, positions, rope, caches[i], attn, self._compressed(i, caches, meta))
        return streams.flatten(1)

    def _compressed(self, layer: int, caches: list[tuple[torch.Tensor, ...]],
                    meta: tuple[BackendMetadata | StateMetadata, ...]) -> CompressedCaches | None:
        if layer not in self.entries_layer:
            return None
        entries, state = self.entries_layer[layer], self.state_layer[layer]
        keys = self.index_layer.get(layer)
        smeta = meta[self.layer_group[state]]
        assert isinstance(smeta, StateMetadata)
        return CompressedCaches(caches[entries][0], meta[self.layer_group[entries]],
                                None if keys is None else caches[keys][0],
                                None if keys is None else meta[self.layer_group[keys]],
                                caches[state], smeta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: forward's streams [N, n * H] -> fp32 logits: collapsed (hc_head), normed, through the head."""
        config = self.config
        streams = hidden.view(hidden.shape[0], config.hc_mult, config.hidden_size)
        return self.head_logits(self.norm(hyper_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                                                     config.hc_eps, config.rms_norm_eps)))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.head is None else self.head.weight
        return F.linear(hidden, weight).float()

    def shard(self, tp: Any) -> dict:
        raise NotImplementedError("DeepSeek-V4 has no tensor-parallel form (tensor_parallel is False)")

    def lay_out_for_cpu(self) -> None:
        """Its unquantized weights stay as torch holds them; quantized layers (the release's FP8 linears and
        MXFP4 experts) take ladle's C kernels for decode rows, where they build."""
        quantized = [m for m in self.modules()
                     if isinstance(m, Fp8Linear) or (isinstance(m, FusedMoE) and m.weight_format)]
        if not quantized:
            return
        try:
            kernels = load_cpu_kernels()
        except KernelUnavailable:
            return  # torch widens them instead: slower, the same numbers
        native_bf16, buffer = pack(torch.zeros(16, 16, dtype=torch.bfloat16)) is not None, WidenBuffer()
        for module in quantized:
            module.use_cpu_kernels(kernels, native_bf16, buffer)
        self.cpu_kernels = ("ladle-c", "FP8 and MXFP4 layers read their bytes in C for decode rows; the rest torch")

    @torch.no_grad()
    def init_dummy_buffers(self, generator: torch.Generator) -> None:
        """Random weights need a valid hash table too: each token to top_k distinct experts."""
        for layer in self.layers:
            assert isinstance(layer, Block)  # the layers are Blocks
            gate = layer.ffn.gate
            if gate.hashed:
                e = self.config.n_routed_experts
                rand = torch.rand(gate.tid2eid.shape[0], e, generator=generator, device=gate.tid2eid.device)
                gate.tid2eid.copy_(rand.argsort(dim=-1)[:, : gate.top_k])

    @staticmethod
    def checkpoint_name(raw: str) -> str:
        """A checkpoint tensor's name as this model's parameters have it (HF saves a `model.` prefix; the one MTP
        layer's `mtp.0.` is the module `mtp`)."""
        name = raw.removeprefix("model.")
        if name.startswith("mtp.0."):
            return "mtp." + name.removeprefix("mtp.0.")
        return _RENAMES.get(name, name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors by DeepSeek's names (with or without HF's `model.` prefix); the multi-token
        prediction layer (`mtp.*`) is read only when it drafts (enable_mtp). Returns the parameters loaded; raises
        on unknown names and on a hash layer without its tid2eid table."""
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for raw, tensor in weights:
                name = self.checkpoint_name(raw)
                if (name.startswith("mtp.") and self.mtp is None) or (name == "head.weight" and self.head is None):
                    continue
                yield name, tensor

        buffers = dict(self.named_buffers())
        loaded = copy_checkpoint(self, renamed(), dict(self.named_parameters()) | buffers)
        missing = sorted(b for b in buffers if b.endswith("tid2eid") and b not in loaded)
        if missing:
            raise ValueError(f"the checkpoint has no hash-routing table for: {', '.join(missing)}")
        return loaded


def _check_config(config: Any) -> None:
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    if config.num_key_value_heads != 1:
        raise ValueError(f"num_key_value_heads is {config.num_key_value_heads}; DeepSeek-V4 attention shares one "
                         "KV head")
    if (config.num_attention_heads * config.head_dim) % config.o_groups:
        raise ValueError(f"o_groups {config.o_groups} does not divide num_attention_heads x head_dim")
    if "compressed_sparse_attention" in config.layer_types and config.head_dim % config.index_head_dim:
        raise ValueError(f"index_head_dim {config.index_head_dim} does not divide head_dim {config.head_dim}: the "
                         "indexer's keys share the pool's page size")
    if getattr(config, "n_shared_experts", 1) != 1:
        raise ValueError(f"n_shared_experts is {config.n_shared_experts}; DeepSeek-V4 has one shared expert (of "
                         "moe_intermediate_size), as HF transformers builds it")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
