"""The Anthropic Messages API through the server with the official anthropic client, on a random-weight Qwen3 in
Qwen3's chat format: text turns, forced tool use whose input validates (streamed through messages.stream(), whose
accumulator checks every event), a tool conversation that round-trips, count_tokens, thinking blocks, and errors
in Anthropic's envelope."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from ladle.entrypoints.openai.anthropic.stream import BlockWriter
from ladle.entrypoints.openai.anthropic.thinking_signature import seal, unseal
from ladle.entrypoints.openai.chat.output import ChoicePiece
from ladle.entrypoints.openai.chat.tool_parsers.base import ToolCallDelta
from ladle.testing.tool_checkpoints import build_tool_checkpoint
from server_harness import ServerProcess

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "weather", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
KEY = "anthropic-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tool_checkpoint(tmp_path_factory.mktemp("qwen3_tools"), "qwen3", seed=2)
    srv = ServerProcess(model, tmp_path_factory.mktemp("anthropic"), "--max-model-len", "2048",
                        api_key=KEY).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def model(server) -> str:
    return httpx.get(server.base_url + "/v1/models", headers=server.headers).json()["data"][0]["id"]


@pytest.mark.server
@pytest.mark.slow
def test_a_text_turn_and_count_tokens(server, client):
    m = model(server)
    msg = client.messages.create(model=m, max_tokens=12, messages=ASK, system="Be brief.", extra_body={"temperature": 0})
    assert msg.type == "message" and msg.role == "assistant" and msg.id
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens <= 12
    assert [b.type for b in msg.content] in (["text"], [])
    count = client.messages.count_tokens(model=m, messages=ASK, system="Be brief.")
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_validates_and_a_tool_conversation_round_trips(server, client, stream):
    m = model(server)
    # Thinking off: the template closes this turn's block, so the forced call starts at the first token.
    kw = dict(model=m, max_tokens=300, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
              thinking={"type": "disabled"}, extra_body={"temperature": 0})
    if stream:
        with client.messages.stream(**kw) as s:  # its accumulator checks every event's shape and order
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses
    for u in uses:
        assert u.name == "get_weather" and u.id.startswith("toolu_")
        jsonschema.validate(u.input, WEATHER)
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny"}
                                                  for u in uses] + [{"type": "text", "text": "Thanks!"}]}]
    answer = client.messages.create(model=m, max_tokens=16, messages=history, tools=TOOLS, extra_body={"temperature": 0})
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    named = client.messages.create(model=m, max_tokens=300, messages=history, tools=TOOLS,
                                   thinking={"type": "disabled"}, extra_body={"temperature": 0},
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True})
    assert [b.type for b in named.content if b.type == "tool_use"] == ["tool_use"]


@pytest.mark.server
@pytest.mark.slow
def test_forced_tool_use_with_defs_and_refs_validates(server, client):
    schema = {"$defs": {"City": {"type": "string", "maxLength": 10}, "Days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7}},
              "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}, "days": {"$ref": "#/$defs/Days"}},
              "required": ["city", "days"], "additionalProperties": False}
    msg = client.messages.create(model=model(server), max_tokens=300, messages=ASK, thinking={"type": "disabled"},
                                 tools=[{"name": "get_weather", "input_schema": schema}],
                                 tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses
    for u in uses:
        jsonschema.validate(u.input, schema)


@pytest.mark.server
@pytest.mark.slow
def test_errors_come_in_anthropics_envelope(server, client):
    m = model(server)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    cases = [
        ({"model": m, "max_tokens": 5, "messages": [{"role": "user", "content": [image]}]}, "not supported"),
        ({"model": m, "messages": ASK}, "max_tokens"),
        ({"model": m, "max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "name"),
        ({"model": m, "max_tokens": 5, "messages": ASK, "container": "x"}, "container"),
        ({"model": "other", "max_tokens": 5, "messages": ASK}, "does not exist"),
        ({"model": m, "max_tokens": 5, "messages": ASK + [  # a result with no tool_use in the turn before it
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
         "messages[2].content[0]: tool_result's tool_use_id 'toolu_1' matches no tool_use"),
    ]
    for body, words in cases:
        r = httpx.post(server.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
        assert r.status_code in (400, 404), r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] in ("invalid_request_error", "not_found_error")
        assert words in err["error"]["message"], err
    r = httpx.post(server.base_url + "/v1/messages", json=cases[1][0], headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=m, max_tokens=5, messages=[{"role": "user", "content": [image]}])


def test_blocks_are_numbered_without_gaps_and_tool_input_goes_out_whole():
    w = BlockWriter(lambda call_id: "toolu_" + call_id)
    events = [*w.take(ChoicePiece(reasoning="hmm")), *w.take(ChoicePiece(reasoning=" ok", content="Sure.")),
              *w.take(ChoicePiece(tool_calls=[ToolCallDelta(0, "1", "get_weather", '{"city": "Pa')])),
              *w.take(ChoicePiece(tool_calls=[ToolCallDelta(0, arguments='ris", "days": 2}')])),
              *w.take(ChoicePiece(tool_calls=[ToolCallDelta(1, "2", "get_weather", "{broken")])), *w.close()]
    parsed = [(e.split("\n")[0][7:], json.loads(e.split("\n")[1][6:])) for e in events]
    starts = [d for name, d in parsed if name == "content_block_start"]
    assert [d["index"] for d in starts] == [0, 1, 2, 3]
    assert [d["content_block"]["type"] for d in starts] == ["thinking", "text", "tool_use", "tool_use"]
    inputs = [d["delta"]["partial_json"] for name, d in parsed if name == "content_block_delta"
              and d["delta"]["type"] == "input_json_delta"]
    assert inputs == ['{"city": "Paris", "days": 2}', "{}"]  # whole, and a broken one never goes out
    assert all(name == d["type"] for name, d in parsed)


def test_omitted_thinking_goes_out_sealed_in_its_signature():
    """thinking.display "omitted": no thinking deltas, the block's text empty, its reasoning in the signature."""
    w = BlockWriter(lambda call_id: "toolu_" + call_id, omit_thinking=True)
    events = [*w.take(ChoicePiece(reasoning="hmm")), *w.take(ChoicePiece(reasoning=" ok", content="Sure.")),
              *w.close()]
    parsed = [json.loads(e.split("\n")[1][6:]) for e in events]
    deltas = [d["delta"] for d in parsed if d["type"] == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["signature_delta", "text_delta"]
    assert unseal("", deltas[0]["signature"]) == "hmm ok"
    assert unseal("shown", deltas[0]["signature"]) == "shown"  # a block with text is taken as sent
    with pytest.raises(ValueError, match="signature is not one ladle wrote"):
        unseal("", "ladle.r1.@@@")


@pytest.mark.server
@pytest.mark.slow
def test_an_omitted_thinking_block_sent_back_renders_as_the_shown_one(server, client):
    """The next turn sees the reasoning an omitted block sealed, exactly as if it had been shown: Qwen3's template
    keeps the reasoning of a turn after the last user message, so the counts are equal and above the bare turn's."""
    m = model(server)
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}}

    def count(thinking: list[dict]) -> int:
        turns = [*ASK, {"role": "assistant", "content": [*thinking, call]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sun"}]}]
        return client.messages.count_tokens(model=m, messages=turns, tools=TOOLS).input_tokens

    reasoning = "Paris is in France; one day is enough."
    shown = count([{"type": "thinking", "thinking": reasoning, "signature": "ladle"}])
    assert shown == count([{"type": "thinking", "thinking": "", "signature": seal(reasoning)}]) > count([])
    r = httpx.post(server.base_url + "/v1/messages", headers={"x-api-key": KEY}, json={
        "model": m, "max_tokens": 5, "tools": TOOLS, "messages": [*ASK, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": "ladle.r1.%%%"}, call]}]})
    assert r.status_code == 400 and "signature is not one ladle wrote" in r.json()["error"]["message"], r.text
