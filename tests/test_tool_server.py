"""Tool calling and reasoning through the server with the official openai client, on a random-weight Qwen3 that
speaks Qwen3's chat format (its template; <tool_call> and <think> as single plain tokens), with the parsers
derived from its architecture: forced calls validate against their schemas, streamed and not; a three-turn tool
conversation round-trips; a forced thinking block comes back as reasoning_content; what ladle lacks is a 400."""
from __future__ import annotations

import json

import jsonschema
import pytest

from ladle.testing.tool_checkpoints import build_tool_checkpoint
from server_harness import ServerProcess, assert_error_envelope, openai_client, served_model

pytestmark = [pytest.mark.server, pytest.mark.slow]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
# pydantic's model_json_schema() of a model with a nested model and an enum: $defs and $ref
PYDANTIC = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                               "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["x", "y"], "additionalProperties": False, "title": "Point"},
                      "Unit": {"enum": ["C", "F"], "title": "Unit", "type": "string"}},
            "type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}, "unit": {"$ref": "#/$defs/Unit"}},
            "required": ["at", "unit"], "additionalProperties": False, "title": "Move"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tool_checkpoint(tmp_path_factory.mktemp("qwen3_tools"), "qwen3", seed=2)
    srv = ServerProcess(model, tmp_path_factory.mktemp("tools"), "--max-model-len", "2048",
                        "--structured-outputs-enable-in-reasoning").start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


model = served_model


def valid(calls) -> None:
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        assert c.id.startswith("call_") and c.type == "function"


def test_the_parsers_are_derived_and_logged(server):
    log = server.log()
    assert "tool-call-parser         hermes  (derived from Qwen3ForCausalLM)" in log
    assert "reasoning-parser         qwen3  (derived from Qwen3ForCausalLM)" in log


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_validate_against_their_schemas(client, choice):
    r = client.chat.completions.create(model=model(client), messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=300, temperature=0.8, seed=1, n=3)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        assert c.message.content is None
        valid(c.message.tool_calls)
        if isinstance(choice, dict):
            assert [t.function.name for t in c.message.tool_calls] == ["get_time"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move"}}])
def test_forced_calls_with_defs_and_refs_validate(client, choice):
    tools = [TOOLS[1], {"type": "function", "function": {"name": "move", "parameters": PYDANTIC}}]
    r = client.chat.completions.create(model=model(client), messages=ASK, tools=tools, tool_choice=choice,
                                       max_tokens=400, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), {**SCHEMAS, "move": PYDANTIC}[c.function.name])


def test_metrics_count_apis_constrained_requests_and_calls(server, client):
    import re

    def value(text: str, name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    before = server.metrics()
    r = client.chat.completions.create(model=model(client), messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=300, temperature=0)
    after = server.metrics()
    calls = len(r.choices[0].message.tool_calls)
    assert value(after, "ladle:tool_calls_total") - value(before, "ladle:tool_calls_total") == calls
    assert value(after, "ladle:structured_output_requests_total") > value(before, "ladle:structured_output_requests_total")
    assert 'ladle:api_requests_total{api="chat_completions"' in after


def test_parallel_tool_calls_false_makes_one_call(client):
    r = client.chat.completions.create(model=model(client), messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=4, n=4)
    assert all(len(c.message.tool_calls) == 1 for c in r.choices)


def test_streamed_calls_arrive_name_first_then_arguments_in_pieces(client):
    stream = client.chat.completions.create(model=model(client), messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=300, temperature=0, stream=True)
    names, args, pieces, finish = {}, {}, 0, None
    for chunk in stream:
        for ch in chunk.choices:
            for t in ch.delta.tool_calls or []:
                if t.function.name is not None:
                    assert t.index not in names and t.id and t.type == "function"
                    names[t.index] = t.function.name
                assert t.index in names  # never arguments before the name
                args[t.index] = args.get(t.index, "") + (t.function.arguments or "")
                pieces += bool(t.function.arguments)
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and names and pieces > len(names)
    whole = client.chat.completions.create(model=model(client), messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=0)
    assert [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls] == \
        [(names[i], args[i]) for i in sorted(names)]


def test_a_three_turn_tool_conversation_round_trips(client):
    m = model(client)
    first = client.chat.completions.create(model=m, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=0)
    calls = first.choices[0].message.tool_calls
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls]
    second = client.chat.completions.create(model=m, messages=history, tools=TOOLS, max_tokens=20, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history += [second.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "And tomorrow?"}]
    third = client.chat.completions.create(model=m, messages=history, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=0)
    valid(third.choices[0].message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_thinking_block_comes_back_as_reasoning_content(client, stream):
    grammar = 'start: "<think>" /[a-z ]{3,20}/ "</think>" "\\n\\n" /[A-Z][a-z]{2,10}\\./'
    kw = dict(model=model(client), messages=ASK, max_tokens=100, temperature=0,
              extra_body={"structured_outputs": {"grammar": grammar}})
    if stream:
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                content += ch.delta.content or ""
    else:
        msg = client.chat.completions.create(**kw).choices[0].message
        reasoning, content = msg.reasoning_content, msg.content
    assert reasoning and "<think>" not in reasoning and all(c.isalpha() or c == " " for c in reasoning)
    assert content[0].isupper() and content.endswith(".") and "</think>" not in content


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "second function"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot also"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "[1]"}}]}]}, "messages", "not a JSON object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", None),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_nope", "content": "sunny"}]},
     "messages[1].tool_call_id", "matches no tool call"),  # a result with no call
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "c", "content": "sunny"}, {
        "role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]}]}, "messages[1].tool_call_id", "'c'"),  # before its call
]


def test_malformed_tool_requests_are_400s_naming_the_field(server):
    for extra, param, words in BAD:
        body = {"messages": ASK, "max_tokens": 4, **extra}
        err = assert_error_envelope(server.post("/v1/chat/completions", body), 400, param=param)
        assert words is None or words in err["message"], err


def test_the_readme_agent_loop_runs_its_tools_and_sends_the_results_back(client):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from agent_loop import FUNCTIONS, run_agent

    messages = run_agent(client, model(client), "What is the weather in Paris and the time in Tokyo?",
                         first_choice="required")
    calls = messages[1]["tool_calls"]
    results = messages[2:2 + len(calls)]
    assert calls and all(r["role"] == "tool" and r["tool_call_id"] == c["id"] for r, c in zip(results, calls))
    assert [r["content"] for r in results] == [FUNCTIONS[c["function"]["name"]](**json.loads(
        c["function"]["arguments"])) for c in calls]
    assert messages[-1]["role"] in ("assistant", "tool")
