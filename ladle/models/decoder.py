"""The decoder-only causal LM that Qwen3 and Llama share; parameter names follow the HF checkpoints."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ladle.attention.backend import BackendMetadata
from ladle.distributed.parallel_state import SINGLE, TensorParallel
from ladle.kernels.cpu_kernels import KernelUnavailable
from ladle.kernels.cpu_kernels import load as load_cpu_kernels
from ladle.kv_cache.specs import AttentionSpec, CacheSpec, layer_groups
from ladle.models.interface import ConfiguredModel
from ladle.models.layers.cpu_linear import CpuHead, CpuLinear, native_bf16_matmul, pack, pack_linears, use_cpu_linears
from ladle.models.layers.decoder_layer import (
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    add_rms_norm,
    head_dim_of,
)
from ladle.models.layers.moe import FusedMoE
from ladle.quantization.fp8_linear import KERNEL_MAX_ROWS
from ladle.quantization.ggml_embedding import GgmlEmbedding
from ladle.quantization.ggml_linear import GgmlLinear
from ladle.quantization.layer_interfaces import StacksCheckpointTensors, View

if TYPE_CHECKING:
    from ladle.models.loading.tensor_parallel import VocabParallelEmbedding

# Checkpoint entries that hold no parameter (old exports saved the rope table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


MlpFactory = Callable[[Any, int], nn.Module]  # (config, layer index) -> the layer's MLP


def dense_mlp(config: Any, layer_idx: int) -> nn.Module:
    return GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                    config.hidden_act)


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention): from layer_types when the config has them (Qwen3's
    use_sliding_window / max_window_layers fill them in), else config.sliding_window for every layer
    (Mistral)."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported; supported: full_attention, sliding_attention")
    if "sliding_attention" in layer_types and not window:
        raise ValueError("the config has sliding_attention layers but no sliding_window")
    return [window if t == "sliding_attention" else None for t in layer_types]


def attention_specs(config: Any, dtype: torch.dtype, num_kv_heads: int | None = None) -> list[CacheSpec]:
    """What each layer of a plain decoder keeps: paged K/V, windowed where the config says so. num_kv_heads:
    the heads one tensor-parallel rank keeps (default: all of them)."""
    num_kv_heads = num_kv_heads or getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return [AttentionSpec(num_kv_heads, head_dim_of(config), dtype, w) for w in layer_windows(config)]


class TextModel(nn.Module):
    """What DecoderForCausalLM reads of the module build_model makes (`model.*` in the checkpoint): this file's
    DecoderModel, or Qwen3.5's HybridModel."""

    # nn.Embedding as built; a GGUF file's blocks (use_ggml_embedding) or this rank's rows (shard) replace it
    embed_tokens: nn.Embedding | GgmlEmbedding | VocabParallelEmbedding
    layers: nn.ModuleList
    rotary_emb: RotaryEmbedding


class DecoderModel(TextModel):
    def __init__(self, config: Any, qk_norm: bool, make_mlp: MlpFactory, qkv_bias: bool | None = None) -> None:
        super().__init__()
        self.layer_group = layer_groups(attention_specs(config, torch.float32))
        # Built on the meta device by the loader; nn.Embedding's own init (normal_) on a meta tensor imports
        # torch._dynamo, 2-4 s of every start, so a meta weight skips it (a real one is initialised as usual).
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, qk_norm, make_mlp(config, i), qkv_bias)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        attn: BackendMetadata | tuple[BackendMetadata, ...],
    ) -> torch.Tensor:
        """attn: the step's metadata per KV cache group (or one, for a model with one group)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        groups = attn if isinstance(attn, tuple) else (attn,)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        residual = None
        for layer, kv_cache, group in zip(self.layers, kv_caches, self.layer_group):
            x, residual = layer(x, residual, cos, sin, kv_cache, groups[group])
        return self.norm(x) if residual is None else add_rms_norm(x, residual, self.norm)[0]


class DecoderForCausalLM(ConfiguredModel):
    """Subclasses declare the per-model knobs: q/k norm, and the MLP of each layer (dense by default);
    biases are read from the config."""

    qk_norm: bool = False
    qkv_bias: bool | None = None  # True: q/k/v biases and none on o_proj (Qwen2); None: config.attention_bias
    tensor_parallel: ClassVar[bool] = True  # shard() covers every layer (a subclass with others says False)
    # Which kernels lay_out_for_cpu gave the model, and what they run (a row of the settings table).
    cpu_kernels: tuple[str, str] | None = ("torch", "F.linear")
    supports_mtp: ClassVar[bool] = False  # a subclass with an MTP layer says True and meets SupportsMtp

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name  # HF's names are the parameters' own

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return dense_mlp(config, layer_idx)

    def build_model(self, config: Any) -> TextModel:
        """The layers, embedding and final norm (`model.*` in the checkpoint)."""
        return DecoderModel(config, self.qk_norm, self.make_mlp, self.qkv_bias)

    def cache_specs(self, dtype: torch.dtype, max_model_len: int | None = None) -> list[CacheSpec]:
        """What each layer keeps per request (ladle.kv_cache.specs), with the cache in dtype (max_model_len
        matters only to models whose per-request state grows with it)."""
        layer = self.model.layers[0]
        assert isinstance(layer, DecoderLayer)  # DecoderModel's layers (Qwen3.5 says its own cache_specs)
        return attention_specs(self.config, dtype, layer.self_attn.num_kv_heads)

    def shard(self, tp: TensorParallel) -> dict:
        """Shard this model (still on the meta device) for rank tp.rank; returns the checkpoint slices it
        loads (ladle.models.loading.tensor_parallel)."""
        from ladle.models.loading.tensor_parallel import shard_decoder

        return shard_decoder(self, tp)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied models have no lm_head module at all, so no device move or meta init can split the pair.
        # an nn.Linear as built; a GGUF file's blocks (use_ggml_linears) or, on CPU, its stand-in (lay_out_for_cpu)
        self.lm_head: nn.Linear | GgmlLinear | CpuLinear | CpuHead | None = (
            None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.cpu_head: CpuHead | CpuLinear | GgmlLinear | None = None
        self.tp: TensorParallel = SINGLE  # the head is vocab-parallel when sharded

    def init_dummy_buffers(self, generator: torch.Generator) -> None:
        """Nothing to fill: every buffer these models have is derived (the rope tables)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[tuple[torch.Tensor, ...]],
        meta: BackendMetadata | tuple[BackendMetadata, ...],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions, caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> fp32 logits [N, vocab], computed in the model dtype like HF. Sharded, each
        rank computes its vocabulary rows and rank 0 gets them all; the other ranks get None."""
        if self.cpu_head is not None:
            return self.tp.gather_to_driver(self.cpu_head(hidden).float())
        return self.tp.gather_to_driver(F.linear(hidden, self._head_weight()).float())

    def _head_weight(self) -> torch.Tensor:
        """The head's weight: the tied embedding's, or the untied head's own."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        assert not isinstance(head, CpuHead)  # a CpuHead stands in for the head only where cpu_head runs it
        return head.weight

    def lay_out_for_cpu(self) -> None:
        """After loading, on CPU: every linear layer (the head too) as a CpuLinear over its own weight, or, where
        ladle's C kernels cannot be built, packed for oneDNN with the head in its own layouts
        (ladle.models.layers.cpu_linear; a no-op where oneDNN cannot pack this dtype here). A tied head keeps the
        embedding as it is (it gathers rows), so packed head layouts are extra memory, counted as weights. A head
        kept in a GGUF file's blocks (its own, or the tied embedding's) reads them through GgmlLinear."""
        head = self._head_weight()
        blocks = self._block_head()
        try:
            kernels = load_cpu_kernels()
        except KernelUnavailable as e:
            self.cpu_head = blocks
            self._pack_for_onednn(head if blocks is None else None, str(e))
            return
        use_cpu_linears(self.model, kernels)
        if blocks is not None:
            blocks.use_cpu_kernels(kernels, native_bf16_matmul())
            self.cpu_head = blocks
        else:
            self.cpu_head = CpuLinear(head, None, kernels)
            if self.lm_head is not None:  # the untied head lives in cpu_head, which stands in for it
                self.lm_head = self.cpu_head
        self.cpu_kernels = ("ladle-c", self._describe_cpu_linears())

    def _describe_cpu_linears(self) -> str:
        parts = [m.describe() for m in (next((m for m in self.modules() if isinstance(m, CpuLinear)), None),) if m]
        qtypes = sorted({m.qtype for m in self.modules() if isinstance(m, GgmlLinear)})
        if qtypes:
            head = f", the head's {self.cpu_head.qtype} too" if isinstance(self.cpu_head, GgmlLinear) else ""
            parts.append(f"GGUF {' / '.join(qtypes)} blocks{head} through ggml_linear (C) for up to "
                         f"{KERNEL_MAX_ROWS} rows, widened tiles above")
        return "; ".join(parts + ["RMSNorm and rope in C too (CpuOps)"])

    def _block_head(self) -> GgmlLinear | None:
        """The head as a GGUF file's blocks: the untied head's own GgmlLinear, or the tied embedding's table."""
        if isinstance(self.lm_head, GgmlLinear):
            return self.lm_head
        embed = self.model.embed_tokens
        return embed.as_head() if self.lm_head is None and isinstance(embed, GgmlEmbedding) else None

    def _pack_for_onednn(self, head: torch.Tensor | None, why: str) -> None:
        """head: None where it stays in GGUF blocks (GgmlLinear's torch path)."""
        if pack_linears(self.model) == 0:
            return
        self.cpu_kernels = ("onednn", f"weights packed for oneDNN; ladle's C kernels are unavailable here ({why})")
        packed = None if head is None else pack(head)
        if head is not None and packed is not None:
            self.cpu_head = CpuHead(head, packed)
            if self.lm_head is not None:  # the untied head's weight now lives only in cpu_head, which stands in
                self.lm_head = self.cpu_head

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (casting dtype and device); returns the names of the
        parameters fully loaded (a stacked one counts once every checkpoint tensor it holds arrived).

        Raises on a name no parameter has, or a shape mismatch, so a wrong checkpoint fails loudly.
        """
        tied_head: list[torch.Tensor] = []

        def kept() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and self.lm_head is None:
                    tied_head[:] = [tensor]  # HF ties lm_head to the embedding; used only if the embedding is absent
                    continue
                yield name, tensor

        params = dict(self.named_parameters())
        loaded = copy_checkpoint(self, kept(), params)
        embed = "model.embed_tokens.weight"
        if tied_head and embed not in loaded:
            params[embed].copy_(tied_head[0])
            loaded.add(embed)
        return loaded


# Checkpoint dtypes copied bit for bit, never converted: FP8 values, E8M0 scales, packed FP4 bytes.
_QUANTIZED = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)


def copy_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    targets: Mapping[str, torch.Tensor]) -> set[str]:
    """Copy each (name, tensor) into targets[name] (a parameter or buffer), or into the view of a stacked
    parameter a module's checkpoint_views gives; returns the targets fully loaded (a stacked one once every
    tensor it holds arrived). Raises on a name with no target or a shape mismatch."""
    views = checkpoint_views(model)
    targets = {**targets, **tiered_targets(model)}
    parts_loaded: dict[str, set[str]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        target, view = views.get(name, (name, None))
        dest = targets.get(target)
        if dest is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        dest = dest if view is None else view(dest)
        if tuple(dest.shape) != tuple(tensor.shape):
            what = "scale grid" if name.endswith("_scale_inv") else "checkpoint"
            raise ValueError(f"{name}: {what} shape {tuple(tensor.shape)} != parameter {tuple(dest.shape)}")
        if (dest.dtype in _QUANTIZED or tensor.dtype in _QUANTIZED) and dest.dtype != tensor.dtype:
            raise ValueError(f"{name}: checkpoint dtype {tensor.dtype} where the model holds {dest.dtype} (a "
                             "quantized tensor needs quantization_config, and a quantized layer the format it names)")
        if name.endswith("_scale_inv") and not bool((torch.isfinite(s := tensor.float()) & (s > 0)).all()):
            raise ValueError(f"{name} has scales that are not finite and positive (NaN, inf or <= 0): a broken "
                             "export, which would turn the layer's outputs to NaN or zero")
        dest.copy_(tensor)
        if view is None:
            loaded.add(name)
        else:
            parts_loaded.setdefault(target, set()).add(name)
    expected: dict[str, set[str]] = {}
    for name, (target, _) in views.items():
        expected.setdefault(target, set()).add(name)
    return loaded | {t for t, names in expected.items() if parts_loaded.get(t) == names}


def tiered_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """The host tensors of experts tiered in host memory, by the parameter names they stand for."""
    table: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, FusedMoE) and prefix:
            table.update(module.tiered_targets(prefix))
    return table


def checkpoint_views(model: nn.Module) -> dict[str, tuple[str, View]]:
    """Checkpoint name -> (parameter name, the view of it the tensor fills), from every module that stacks
    several checkpoint tensors into one parameter (StackedLinear's shards, FusedMoE's experts)."""
    table: dict[str, tuple[str, View]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, StacksCheckpointTensors) and prefix:
            table.update(module.checkpoint_views(prefix))
    return table
