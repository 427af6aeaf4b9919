"""Tool-call parsers by name (vLLM's --tool-call-parser names), and the ones each architecture's templates use."""
from __future__ import annotations

from ladle.entrypoints.openai.chat.tool_parsers.base import ToolFormat
from ladle.entrypoints.openai.chat.tool_parsers.deepseek_v4 import DeepSeekV4Format
from ladle.entrypoints.openai.chat.tool_parsers.hermes import HermesFormat
from ladle.entrypoints.openai.chat.tool_parsers.llama3_json import Llama3JsonFormat
from ladle.entrypoints.openai.chat.tool_parsers.qwen3_xml import Qwen3XmlFormat

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Qwen3XmlFormat(), DeepSeekV4Format(),
                                                       Llama3JsonFormat())}

# config.json's architecture -> (tool-call parser, reasoning parser) its family's chat templates speak.
ARCHITECTURE_PARSERS: dict[str, tuple[str | None, str | None]] = {
    "Qwen3ForCausalLM": ("hermes", "qwen3"),
    "Qwen3MoeForCausalLM": ("hermes", "qwen3"),
    "Qwen3_5ForCausalLM": ("qwen3_coder", "qwen3"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_coder", "qwen3"),
    "Qwen3_5MoeForCausalLM": ("qwen3_coder", "qwen3"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_coder", "qwen3"),
    # Qwen3.8-Flash-Next (issue 60): Qwen3.5's lineage (its 248,320-token vocabulary and Gated DeltaNet layers);
    # no release template is at hand to say otherwise, so Qwen3.5's formats, which --tool-call-parser overrides.
    "Qwen4ExpForCausalLM": ("qwen3_coder", "qwen3"),
    "Qwen4ExpForConditionalGeneration": ("qwen3_coder", "qwen3"),
    "DeepseekV4ForCausalLM": ("deepseek_v4", "deepseek_v4"),
    "LlamaForCausalLM": ("llama3_json", None),
}
