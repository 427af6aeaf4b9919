"""Every request field is honoured, or a documented no-op, or a 400 naming it. This file is the list of no-ops.

A no-op is allowed only where ignoring the field cannot change what the model sees or generates: cache and
routing hints, client metadata, things a stateless server already does. Real clients send them on every
request (Codex CLI's client_metadata, Claude Code's cache_control), so a 400 on one locks the client out; each
is counted on /metrics (ladle:no_op_fields_total, by API and field) and listed in the README's table, which a
test holds equal to NO_OPS. A field outside the protocol models is still a 400, since they forbid extra keys. The
session hints (prompt_cache_key, metadata.user_id) are honoured,
not listed: the prefix cache keeps a session's prefix for its next turn (ladle.kv_cache.session_retention), and
`ladle serve-replicas`' router sends a session to one replica (session_routing.py).

Paths are dotted field names as the request spells them, `[]` standing for every element of a list; a value
entry (`path=value`) is a no-op only when the field holds that value (the code that serves the field counts it),
a header entry (`name: value`) is one value of a comma-separated request header, and a query entry (`?name=value`)
one parameter of the URL's query string: any other query parameter on an API route is a 400 naming it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from ladle.entrypoints.openai.protocol_base import OpenAIError, clip


@dataclass(frozen=True)
class NoOp:
    api: str  # chat_completions, completions, responses or messages
    path: str
    why: str  # why ignoring it cannot change what the model sees or generates
    kind: Literal["field", "value", "header", "query"] = "field"


_USER = "an end-user id for the provider's abuse monitoring; nothing here reads it"
_CACHE = "a prompt-caching hint: ladle caches every prefix on its own, and a hit never changes the output"
_ENABLES = "a beta switch for request fields that are served, or refused by name, on their own"

BILLING_PREFIX = "x-anthropic-billing-header:"  # Claude Code's first system block
BILLING_HEADER = f"system[].text={BILLING_PREFIX} ..."
KEEP_ALL_THINKING = "context_management.edits[].keep=all"
MESSAGES_EFFORT = "output_config.effort=*"  # counted by serving_messages
BETA = "anthropic-beta"
_TIER = "one tier here: every value is served alike"
_VERBOSITY = ("a length hint OpenAI's GPT-5 models were trained to follow; the model here has no such control, so it "
              "answers as it would without it")
_EFFORT = ("counted only where the chat template has no control for the grade: with only a thinking switch (Qwen3's "
           "enable_thinking) the model thinks at its one grade for every value but none (which turns thinking off), "
           "with neither no value reaches it; a template that reads reasoning_effort gets every value")
_HOSTED = ("a tool OpenAI runs on its side; none runs here, so it is not shown to the model, which answers as if it "
           "chose not to call it (an offered tool is optional; tool_choice requiring it is a 400)")
CHAT_EFFORT = "reasoning_effort=*"  # counted by serving_chat
RESPONSES_EFFORT = "reasoning.effort=*"  # counted by serving_responses


def hosted_tool(kind: str) -> str:
    """The no-op entry of a hosted tool of this type, offered (counted by serving_responses)."""
    return f"tools[].type={kind}"

NO_OPS: tuple[NoOp, ...] = (
    NoOp("chat_completions", "user", _USER),
    NoOp("completions", "user", _USER),
    NoOp("responses", "user", _USER),
    NoOp("messages", "service_tier", "one tier here: auto and standard_only mean the same"),
    NoOp("messages", "cache_control", _CACHE),
    NoOp("messages", "tools[].cache_control", _CACHE),
    NoOp("messages", "system[].cache_control", _CACHE),
    NoOp("messages", "messages[].content[].cache_control", _CACHE),
    NoOp("messages", BILLING_HEADER, "billing metadata for Anthropic's servers (a version and a per-session or "
         "per-request hash); left out of the prompt, so sessions share the system prompt's prefix", "value"),
    NoOp("messages", KEEP_ALL_THINKING, "clear_thinking that keeps every turn's thinking: the template gets every "
         "thinking block, as without the edit", "value"),
    NoOp("messages", MESSAGES_EFFORT, "counted only where the chat template has no reasoning_effort control "
         "(Qwen3's, DeepSeek's): the model thinks as `thinking` says, at its one grade, for every value; a template "
         "that reads reasoning_effort gets every value", "value"),
    NoOp("messages", f"{BETA}: claude-code-20250219", "names the client; enables nothing here", "header"),
    NoOp("messages", f"{BETA}: interleaved-thinking-2025-05-14", "thinking between tool calls: a model here thinks "
         "wherever its chat template lets it, with or without it", "header"),
    NoOp("messages", f"{BETA}: thinking-token-count-2026-05-13", "asks usage to count thinking tokens apart; "
         "output_tokens counts them", "header"),
    NoOp("messages", f"{BETA}: context-management-2025-06-27", _ENABLES, "header"),
    NoOp("messages", f"{BETA}: mid-conversation-system-2026-04-07", _ENABLES, "header"),
    NoOp("messages", f"{BETA}: mid-conversation-system-clear-at-2026-08-21", _ENABLES, "header"),
    NoOp("messages", f"{BETA}: effort-2025-11-24", _ENABLES, "header"),
    NoOp("messages", f"{BETA}: structured-outputs-2025-11-13", _ENABLES, "header"),
    NoOp("messages", f"{BETA}: advanced-tool-use-2025-11-20", _ENABLES, "header"),
    NoOp("messages", f"{BETA}: token-counting-2024-11-01", _ENABLES, "header"),
    NoOp("messages", f"{BETA}: prompt-caching-scope-2026-01-05", _CACHE, "header"),
    NoOp("messages", f"{BETA}: prompt-caching-2024-07-31", _CACHE, "header"),
    NoOp("messages", f"{BETA}: extended-cache-ttl-2025-04-11", _CACHE, "header"),
    NoOp("messages", f"{BETA}: fine-grained-tool-streaming-2025-05-14", "streams a call's input in smaller pieces; "
         "the input is the same", "header"),
    NoOp("messages", f"{BETA}: output-128k-2025-02-19", "raises Anthropic's max_tokens cap; here max_model_len "
         "bounds max_tokens either way", "header"),
    NoOp("messages", f"{BETA}: context-1m-2025-08-07", "widens Anthropic's context window; here max_model_len "
         "is the window either way", "header"),
    NoOp("messages", "?beta=true", "the Anthropic SDK's beta client marks its URLs so (Claude Code's do); the beta "
         "features it uses are named in anthropic-beta, each served or refused there", "query"),
    NoOp("chat_completions", "metadata", "client metadata for OpenAI's stored completions; nothing is stored here "
         "and nothing reads it"),
    NoOp("chat_completions", "service_tier", _TIER),
    NoOp("chat_completions", "verbosity", _VERBOSITY),
    NoOp("chat_completions", CHAT_EFFORT, _EFFORT, "value"),
    NoOp("responses", "include", "asks for the reasoning encrypted, for a stateless client to send back; nothing "
         "here is encrypted or kept: reasoning items carry the thinking as text, which comes back as it went"),
    NoOp("responses", "client_metadata", "client metadata (Codex's session and turn ids); nothing here reads it"),
    NoOp("responses", "service_tier", _TIER),
    NoOp("responses", "text.verbosity", _VERBOSITY),
    NoOp("responses", "reasoning.summary", "asks for a summary of the reasoning, which OpenAI writes with another "
         "model afterwards; none is written here (the reasoning item carries the thinking itself), and the model "
         "generates the same either way"),
    NoOp("responses", RESPONSES_EFFORT, _EFFORT, "value"),
    *(NoOp("responses", hosted_tool(kind), _HOSTED, "value") for kind in (
        "web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
        "image_generation", "mcp")),
    NoOp("responses", hosted_tool("local_shell"), "Codex's older shell tool, whose calls are items of their own "
         "(local_shell_call) ladle does not write; not shown to the model, which answers as if it chose not to call "
         "it (an offered tool is optional; tool_choice requiring it is a 400)", "value"),
)


def no_op_fields(api: str, request: BaseModel) -> list[str]:
    """The no-op fields of NO_OPS that request sets, each once."""
    wanted = {n.path for n in NO_OPS if n.api == api and n.kind == "field"}
    # Only the branches that lead to a no-op are walked: a prompt's thousands of blocks are not visited.
    leads = {p[:i] for p in wanted for i in range(len(p) + 1) if i == len(p) or p[i] in ".["}
    found: set[str] = set()
    _walk(request, "", wanted, leads, found)
    return sorted(found)


def _walk(value: Any, prefix: str, wanted: set[str], leads: set[str], found: set[str]) -> None:
    if isinstance(value, BaseModel):
        for name in value.model_fields_set:
            field = type(value).model_fields.get(name)
            key = field.alias if field is not None and field.alias else name
            path = f"{prefix}.{key}" if prefix else key
            if path not in leads:
                continue
            child = getattr(value, name)
            if path in wanted and child is not None:
                found.add(path)
            _walk(child, path, wanted, leads, found)
    elif isinstance(value, list) and f"{prefix}[]" in leads:
        for item in value:
            _walk(item, f"{prefix}[]", wanted, leads, found)


def header_no_ops(api: str, name: str, value: str | None) -> list[str]:
    """The NO_OPS entries of a comma-separated header's values; a value that is not one is a 400 naming it (it
    may ask for what ladle does not do)."""
    known = {n.path for n in NO_OPS if n.api == api and n.kind == "header"}
    out = []
    for v in (value or "").split(","):
        if not v.strip():
            continue
        path = f"{name}: {v.strip()}"
        if path not in known:
            values = sorted(p.removeprefix(f"{name}: ") for p in known if p.startswith(f"{name}: "))
            raise OpenAIError(400, f"{name} header: {clip(v.strip())!r} is not a value this server knows, so what it "
                              f"asks for would not be done; known: {', '.join(values)}", code="unsupported_parameter",
                              param=name)
        out.append(path)
    return sorted(set(out))


def query_no_ops(api: str, query: Mapping[str, str]) -> list[str]:
    """The NO_OPS entries of a URL's query parameters; any other parameter is a 400 naming it (the API routes
    take their input in the body, so a parameter this server does not know would go unread)."""
    known = {n.path for n in NO_OPS if n.api == api and n.kind == "query"}
    out = []
    for name, value in query.items():
        path = f"?{name}={value}"
        if path not in known:
            raise OpenAIError(400, f"query parameter {clip(name)!r}={clip(value)!r} is not one this route takes "
                              f"(known: {', '.join(sorted(known)) or 'none'}); send request fields in the body",
                              code="unsupported_parameter", param=name)
        out.append(path)
    return sorted(set(out))
