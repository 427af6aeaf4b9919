"""How much of a Claude Code request the prefix cache served, as the answer's usage says, and how long the part every
session shares is: for the client tests and the agent session benchmark."""
from __future__ import annotations

from typing import Any

import httpx

from agent_clients.clients import API_KEY
from agent_clients.forcing_proxy import Seen


def is_conversation(seen: Seen) -> bool:
    """One of the conversation's own requests (Messages, with the client's tools): Claude Code's side requests
    (a title, a topic) carry no tools, and count_tokens generates nothing."""
    return seen.path.split("?")[0] == "/v1/messages" and isinstance(seen.body, dict) and bool(seen.body.get("tools"))


def cached_and_computed(seen: Seen) -> tuple[int, int]:
    """The prompt tokens the prefix cache served and those computed (Anthropic's cache_read_input_tokens and
    input_tokens)."""
    return int(seen.usage.get("cache_read_input_tokens", 0)), int(seen.usage.get("input_tokens", 0))


def system_and_tools_tokens(base_url: str, body: dict[str, Any]) -> int:
    """count_tokens of a request's system prompt and tools with a one-word user message: the prefix every session
    of the client shares, and a few tokens more."""
    probe = {"model": body["model"], "system": body.get("system"), "tools": body.get("tools"),
             "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(base_url + "/v1/messages/count_tokens", json={k: v for k, v in probe.items() if v is not None},
                   headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}, timeout=300)
    r.raise_for_status()
    return int(r.json()["input_tokens"])
