"""Model classes by the HF `config.architectures[0]` name."""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ladle.models.deepseek_v4.model import DeepseekV4ForCausalLM
from ladle.models.interface import ConfiguredModel
from ladle.models.llama import LlamaForCausalLM
from ladle.models.mistral import MistralForCausalLM
from ladle.models.qwen2 import Qwen2ForCausalLM
from ladle.models.qwen3 import Qwen3ForCausalLM
from ladle.models.qwen3_5.model import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from ladle.models.qwen3_moe import Qwen3MoeForCausalLM
from ladle.models.qwen4_exp.model import Qwen4ExpForCausalLM

MODELS: Mapping[str, type[ConfiguredModel]] = MappingProxyType({
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "Qwen4ExpForCausalLM": Qwen4ExpForCausalLM,
    # Image-text checkpoints whose text model ladle serves: built from their text_config (text_config_of).
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
    "Qwen4ExpForConditionalGeneration": Qwen4ExpForCausalLM,
})


def text_config_of(config: Any) -> Any:
    """The config ladle builds from: an image-text checkpoint's text_config (keeping its architecture name
    and the top-level word-embedding tying, which HF keeps there), any other config as it is."""
    architectures = getattr(config, "architectures", None) or []
    text = getattr(config, "text_config", None)
    if text is None or not architectures or not architectures[0].endswith("ForConditionalGeneration"):
        return config
    text.architectures = list(architectures)
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))
    return text


def model_class_for(config: Any) -> type[ConfiguredModel]:
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"config names no architecture; supported: {', '.join(MODELS)}")
    name = architectures[0]
    if name not in MODELS:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(MODELS)}")
    return MODELS[name]
