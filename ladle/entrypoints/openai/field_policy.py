"""Every request field is honoured, or a documented no-op, or a 400 naming it. This file is the list of no-ops.

A no-op is allowed only where ignoring the field cannot change what the model sees or generates: cache and
routing hints, client metadata, things a stateless server already does. Real clients send them on every
request (Codex CLI's prompt_cache_key and client_metadata, Claude Code's cache_control and metadata.user_id),
so a 400 on one locks the client out; each is counted on /metrics (ladle:no_op_fields_total, by API and field)
and listed in the README's table, which a test holds equal to NO_OPS. A field outside the protocol models is
still a 400, since they forbid extra keys.

Paths are dotted field names as the request spells them, `[]` standing for every element of a list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True)
class NoOp:
    api: str  # chat_completions, completions, responses or messages
    path: str
    why: str  # why ignoring it cannot change what the model sees or generates


_USER = "an end-user id for the provider's abuse monitoring; nothing here reads it"
_CACHE = "a prompt-caching hint: ladle caches every prefix on its own, and a hit never changes the output"

NO_OPS: tuple[NoOp, ...] = (
    NoOp("chat_completions", "user", _USER),
    NoOp("completions", "user", _USER),
    NoOp("responses", "user", _USER),
    NoOp("messages", "metadata", "client metadata (Claude Code's user_id); nothing here reads it"),
    NoOp("messages", "service_tier", "one tier here: auto and standard_only mean the same"),
    NoOp("messages", "tools[].cache_control", _CACHE),
    NoOp("messages", "system[].cache_control", _CACHE),
    NoOp("messages", "messages[].content[].cache_control", _CACHE),
)


def no_op_fields(api: str, request: BaseModel) -> list[str]:
    """The no-op fields of NO_OPS that request sets, each once."""
    wanted = {n.path for n in NO_OPS if n.api == api}
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
