"""The decoder-only causal LM that Qwen3 and Llama share; parameter names follow the HF checkpoints."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ladle.models.layers import DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding, add_rms_norm
from ladle.worker.inputs import AttentionMetadata

# Checkpoint entries that hold no parameter (old exports saved the rope table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


MlpFactory = Callable[[Any, int], nn.Module]  # (config, layer index) -> the layer's MLP


def dense_mlp(config: Any, layer_idx: int) -> nn.Module:
    return GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                    config.hidden_act)


class DecoderModel(nn.Module):
    def __init__(self, config: Any, qk_norm: bool, make_mlp: MlpFactory) -> None:
        super().__init__()
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"only full attention is supported; config has layer_types {sorted(set(layer_types))}")
        # Built on the meta device by the loader; nn.Embedding's own init (normal_) on a meta tensor imports
        # torch._dynamo, 2-4 s of every start, so a meta weight skips it (a real one is initialised as usual).
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, qk_norm, make_mlp(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, attn)
        return self.norm(x) if residual is None else add_rms_norm(x, residual, self.norm)[0]


class DecoderForCausalLM(nn.Module):
    """Subclasses declare the per-model knobs: q/k norm, and the MLP of each layer (dense by default);
    biases are read from the config."""

    qk_norm: bool = False

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return dense_mlp(config, layer_idx)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.qk_norm, self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied models have no lm_head module at all, so no device move or meta init can split the pair.
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab], computed in the model dtype like HF."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (casting dtype and device); returns the names of the
        parameters fully loaded (a stacked one counts once every checkpoint tensor it holds arrived).

        Raises on a name no parameter has, or a shape mismatch, so a wrong checkpoint fails loudly.
        """
        params = dict(self.named_parameters())
        views = checkpoint_views(self)
        parts_loaded: dict[str, set[str]] = {}
        loaded: set[str] = set()
        tied_head: torch.Tensor | None = None
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                tied_head = tensor  # HF ties lm_head to the embedding; used only if the embedding is absent
                continue
            target, view = views.get(name, (name, None))
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            dest = param if view is None else view(param)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(dest.shape)}")
            dest.copy_(tensor)
            if view is None:
                loaded.add(name)
            else:
                parts_loaded.setdefault(target, set()).add(name)
        expected: dict[str, set[str]] = {}
        for name, (target, _) in views.items():
            expected.setdefault(target, set()).add(name)
        loaded |= {t for t, names in expected.items() if parts_loaded.get(t) == names}
        embed = "model.embed_tokens.weight"
        if tied_head is not None and embed not in loaded:
            params[embed].copy_(tied_head)
            loaded.add(embed)
        return loaded


def checkpoint_views(model: nn.Module) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """Checkpoint name -> (parameter name, the view of it the tensor fills), from every module that stacks
    several checkpoint tensors into one parameter (StackedLinear's shards, FusedMoE's experts)."""
    table: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {}
    for prefix, module in model.named_modules():
        views = getattr(module, "checkpoint_views", None)
        if callable(views) and prefix:
            table.update(views(prefix))
    return table
