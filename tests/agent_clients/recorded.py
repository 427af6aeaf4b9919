"""The first requests of the released agent CLIs, as recorded (tests/fixtures/agent_requests/<client>-<version>.json:
method, path, headers without auth, body), and the tools' schemas each one sends."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORDED = Path(__file__).resolve().parent.parent / "fixtures" / "agent_requests"


def recorded_requests() -> dict[str, dict[str, Any]]:
    """client-version -> its recorded request."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(RECORDED.glob("*.json"))}


def tool_schemas(body: dict[str, Any]) -> dict[str, Any]:
    """Each function tool's parameters by the name the model is shown, whatever the API: Anthropic's input_schema,
    the Responses API's functions (in a namespace: `<namespace>.<name>`, as ladle flattens them), Chat Completions'
    function.parameters. Built-in tools (web_search) have no schema of the client's and are left out."""
    out: dict[str, Any] = {}
    for tool in body.get("tools") or []:
        if "input_schema" in tool:
            out[tool["name"]] = tool["input_schema"]
        elif tool.get("type") == "namespace":
            out.update({f"{tool['name']}.{name}": s for name, s in tool_schemas({"tools": tool["tools"]}).items()})
        elif tool.get("type") == "function" and "function" in tool:
            out[tool["function"]["name"]] = tool["function"].get("parameters") or {}
        elif tool.get("type") == "function":
            out[tool["name"]] = tool.get("parameters") or {}
    return out
