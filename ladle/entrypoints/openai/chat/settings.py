"""The server's chat settings: which tool-call and reasoning parsers read the model's output, whether the model
may choose to call tools (tool_choice "auto"), and the chat template; each explicit, or derived from the
checkpoint's architecture, and logged at startup with where it came from."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladle.entrypoints.openai.chat.reasoning_parser import PARSERS, ReasoningParser
from ladle.entrypoints.openai.chat.tool_parsers import ARCHITECTURE_PARSERS, FORMATS
from ladle.entrypoints.openai.chat.tool_parsers.base import ToolFormat
from ladle.gguf.path import gguf_file_of


@dataclass(frozen=True)
class ChatSettings:
    tool_format: ToolFormat | None = None
    reasoning: ReasoningParser | None = None
    auto_tool_choice: bool = False
    chat_template: str | None = None  # replaces the tokenizer's
    # vLLM's structured_outputs_config.enable_in_reasoning: a constraint holds from the first token, thinking
    # included (the grammar itself then spells the thinking block), instead of waiting for the block's end.
    enable_in_reasoning: bool = False
    provenance: tuple[str, ...] = ()  # one line per setting, for the startup log

    def report(self) -> str:
        return "\n".join(self.provenance)


def architecture(model_dir: str) -> str:
    gguf = gguf_file_of(model_dir)
    if gguf is not None:  # the architecture ladle builds from the file (ladle.gguf.config)
        from ladle.gguf.config import ARCHITECTURES
        from ladle.gguf.reader import read_gguf

        arch = read_gguf(gguf).metadata.get("general.architecture")
        return ARCHITECTURES.get(arch, "") if isinstance(arch, str) else ""
    try:
        archs = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return ""
    return archs[0] if archs else ""


def resolve_chat_settings(tool_call_parser: str | None, reasoning_parser: str | None, enable_auto_tool_choice: bool,
                          chat_template: str | None, arch: str, enable_in_reasoning: bool = False) -> ChatSettings:
    """Explicit values win (an unknown name is refused, naming the choices); unset ones are derived from the
    architecture; "none" turns a parser off."""
    derived_tool, derived_reasoning = ARCHITECTURE_PARSERS.get(arch, (None, None))
    lines = []

    def pick(flag: str, given: str | None, derived: str | None, table: dict[str, Any]) -> Any:
        if given is not None:
            if given != "none" and given not in table:
                raise ValueError(f"{flag} {given!r} is not one ladle has; choose one of {', '.join(sorted(table))} "
                                 "or none")
            lines.append(f"{flag.lstrip('-'):<24} {given}  (explicit)")
            return table.get(given)
        if derived in table:
            lines.append(f"{flag.lstrip('-'):<24} {derived}  (derived from {arch})")
            return table[derived]
        why = f"{derived} is not built yet" if derived else f"no parser for {arch or 'this architecture'}"
        lines.append(f"{flag.lstrip('-'):<24} none  (derived: {why})")
        return None

    fmt = pick("--tool-call-parser", tool_call_parser, derived_tool, FORMATS)
    reasoning = pick("--reasoning-parser", reasoning_parser, derived_reasoning, PARSERS)
    if enable_auto_tool_choice and fmt is None:
        raise ValueError("--enable-auto-tool-choice needs a tool-call parser: set --tool-call-parser "
                         f"({', '.join(sorted(FORMATS))})")
    auto = fmt is not None
    lines.append(f"{'enable-auto-tool-choice':<24} {auto}  ({'explicit' if enable_auto_tool_choice else 'derived'})")
    template = None
    if chat_template is not None:
        path = Path(chat_template)
        template = path.read_text() if path.is_file() else chat_template  # a file, or the template itself (vLLM)
        lines.append(f"{'chat-template':<24} {chat_template if path.is_file() else '(inline)'}  (explicit)")
    if enable_in_reasoning:
        if reasoning is None:
            raise ValueError("--structured-outputs-enable-in-reasoning needs a reasoning parser (--reasoning-parser)")
        lines.append(f"{'enable-in-reasoning':<24} True  (explicit)")
    return ChatSettings(fmt, reasoning, auto, template, enable_in_reasoning, tuple(lines))
