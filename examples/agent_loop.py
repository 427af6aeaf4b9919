"""A two-tool agent loop against `ladle serve`, with the official openai client: the model calls tools, the
loop runs them and sends their results back, until the model answers (or max_turns).

    ladle serve MODEL --port 8000 &
    python examples/agent_loop.py --base-url http://127.0.0.1:8000/v1 "What is the weather in Paris?"
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
                       "required": ["zone"], "additionalProperties": False}}},
]
FUNCTIONS: dict[str, Callable[..., str]] = {
    "get_weather": lambda city: f"{city}: 21 C, sunny",
    "get_time": lambda zone: {"UTC": "12:00", "CET": "13:00", "JST": "21:00"}[zone],
}


def run_agent(client: OpenAI, model: str, question: str, max_turns: int = 4,
              first_choice: str = "auto") -> list[dict[str, Any]]:
    """The conversation, from the question to the model's answer. first_choice: the first turn's tool_choice
    ("required" makes the model call a tool before it may answer)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for turn in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=256,
                                               tool_choice=first_choice if turn == 0 else "auto")
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break  # the model answered
        for call in msg.tool_calls:
            result = FUNCTIONS[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("question")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="unused")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    for m in run_agent(client, model, args.question):
        print(f"{m['role']:>9}: {m.get('content') or ''}{json.dumps(m['tool_calls']) if m.get('tool_calls') else ''}")


if __name__ == "__main__":
    main()
