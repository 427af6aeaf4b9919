"""The OpenAI Responses API (stateless) through the server with the official openai client, on a random-weight
Qwen3 in Qwen3's chat format: text, forced function calls that validate (responses.create streamed and not,
and responses.stream(), whose state checks the event sequence), a tool conversation fed back as items,
text.format json_schema, max_output_tokens as incomplete, and 400s for what a stateless server lacks."""
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
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tool_checkpoint(tmp_path_factory.mktemp("qwen3_tools"), "qwen3", seed=2)
    srv = ServerProcess(model, tmp_path_factory.mktemp("responses"), "--max-model-len", "2048",
                        "--structured-outputs-enable-in-reasoning").start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


model = served_model


def test_text_in_text_out_and_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model=model(client), input="Say hello.", instructions="Be brief.",
                                max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.output_text == "".join(p.text for item in r.output if item.type == "message" for p in item.content)


@pytest.mark.parametrize("how", ["create", "create-stream", "stream"])
def test_forced_function_calls_validate(client, how):
    kw = dict(model=model(client), input="Weather in Paris?", tools=TOOLS, tool_choice="required",
              max_output_tokens=300, temperature=0)
    if how == "create":
        r = client.responses.create(**kw)
    elif how == "create-stream":
        events = list(client.responses.create(stream=True, **kw))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        r = events[-1].response
    else:
        with client.responses.stream(**kw) as s:  # checks ids, indexes and order of every event
            r = s.get_final_response()
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls
    for c in calls:
        assert c.name == "get_weather" and c.call_id
        jsonschema.validate(json.loads(c.arguments), WEATHER)


def test_a_tool_conversation_round_trips_as_items(client):
    m = model(client)
    first = client.responses.create(model=m, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                    max_output_tokens=300, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    items = [{"role": "user", "content": "Weather in Paris?"}] + [item.model_dump() for item in first.output]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
    second = client.responses.create(model=m, input=items, tools=TOOLS, max_output_tokens=12, temperature=0)
    assert second.status in ("completed", "incomplete")
    items += [item.model_dump() for item in second.output] + [{"role": "user", "content": "And tomorrow?"}]
    third = client.responses.create(model=m, input=items, tools=TOOLS, tool_choice={"type": "function",
                                                                                    "name": "get_weather"},
                                    max_output_tokens=300, temperature=0)
    assert [item.type for item in third.output] == ["function_call"]


def test_forced_calls_with_defs_and_refs_validate(client):
    schema = {"$defs": {"Days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "days": {"$ref": "#/$defs/Days"}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "name": "get_weather", "parameters": schema}]
    r = client.responses.create(model=model(client), input="Weather in Paris?", tools=tools, tool_choice="required",
                                max_output_tokens=300, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), schema)


def test_text_format_json_schema_is_enforced(client):
    r = client.responses.create(model=model(client), input="Report the weather.", max_output_tokens=300,
                                temperature=0, text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER,
                                                                "strict": True}})
    jsonschema.validate(json.loads(r.output_text), WEATHER)


BAD = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"tools": [{"type": "shell"}]}, "tools"),  # a tool type this server does not know
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),  # none runs here
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB"}]}, "input"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"},  # before its call
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}]},
     "input[0].call_id"),
]


def test_what_a_stateless_server_lacks_is_a_400_naming_it(server, client):
    m = model(client)
    for extra, param in BAD:
        body = {"model": m, "input": "hi", "max_output_tokens": 4, **extra}
        assert_error_envelope(server.post("/v1/responses", body), 400, param=param)
