"""Model classes by the HF `config.architectures[0]` name."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from torch import nn

from ladle.models.llama import LlamaForCausalLM
from ladle.models.mistral import MistralForCausalLM
from ladle.models.qwen3 import Qwen3ForCausalLM
from ladle.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from ladle.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: Mapping[str, type[nn.Module]] = MappingProxyType({
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
})


def model_class_for(config: Any) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"config names no architecture; supported: {', '.join(_MODELS)}")
    name = architectures[0]
    if name not in _MODELS:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(_MODELS)}")
    return _MODELS[name]
