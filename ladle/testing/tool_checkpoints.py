"""Tiny random-weight checkpoints that speak each tool-calling family's chat format: the family's template
(chat_templates/*.jinja, checked against the official ones where they exist) and its tags as single plain
tokens, as the real vocabularies have them, so grammars, parsers and the reasoning gate meet what a real model
of that family writes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ladle.demo import build_checkpoint

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"

# family -> (template file, plain tokens its format needs)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "qwen3": ("qwen3.jinja", ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                              "</tool_response>")),
    "qwen3_5": ("qwen35_xml.jinja", ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                     "</tool_response>")),
    "deepseek_v4": ("deepseek_v4.jinja", ("<think>", "</think>")),
    "llama3": ("llama3_json.jinja", ()),
}


def build_tool_checkpoint(out_dir: str | Path, family: str, **kwargs: Any) -> str:
    template, tokens = FAMILIES[family]
    return build_checkpoint(out_dir, added_tokens=tokens, chat_template=(TEMPLATES / template).read_text(), **kwargs)
