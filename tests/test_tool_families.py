"""Every tool-call family end to end: a random-weight checkpoint with that family's chat template, served with
its parsers, forced calls through the openai client (chat, streamed and not, and responses.create) and the
anthropic client (messages.stream) that validate against their schemas."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from ladle.testing.tool_checkpoints import build_tool_checkpoint
from server_harness import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "units": {"enum": ["C", "F"]}},
           "required": ["city", "days"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# family -> the server's parser flags (the test models are Qwen3 by architecture, so each family is named)
FAMILIES = {
    "qwen3_5": ("--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3",
                "--structured-outputs-enable-in-reasoning"),
    "deepseek_v4": ("--tool-call-parser", "deepseek_v4", "--reasoning-parser", "deepseek_v4",
                    "--structured-outputs-enable-in-reasoning"),
    "llama3": ("--tool-call-parser", "llama3_json", "--reasoning-parser", "none"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    family = request.param
    model = build_tool_checkpoint(tmp_path_factory.mktemp(family), family, seed=3)
    srv = ServerProcess(model, tmp_path_factory.mktemp(f"{family}-log"), "--max-model-len", "2048",
                        *FAMILIES[family]).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_forced_calls_validate_through_all_three_apis(served):
    oc = openai.OpenAI(base_url=served.base_url + "/v1", api_key="none", max_retries=0)
    m = oc.models.list().data[0].id
    args = []
    for stream in (False, True):
        # One call each: a random model rarely ends a run of parallel calls (a real one does).
        kw = dict(model=m, messages=ASK, tools=CHAT_TOOLS, tool_choice="required", max_tokens=300, temperature=0,
                  parallel_tool_calls=False)
        if stream:
            text, finish = {}, None
            for chunk in oc.chat.completions.create(stream=True, **kw):
                for ch in chunk.choices:
                    for t in ch.delta.tool_calls or []:
                        text[t.index] = text.get(t.index, "") + (t.function.arguments or "")
                    finish = ch.finish_reason or finish
            args += list(text.values())
        else:
            r = oc.chat.completions.create(**kw)
            finish = r.choices[0].finish_reason
            args += [t.function.arguments for t in r.choices[0].message.tool_calls]
        assert finish == "tool_calls"
    named = oc.chat.completions.create(model=m, messages=ASK, tools=CHAT_TOOLS, max_tokens=300, temperature=0.8,
                                       seed=5, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args += [t.function.arguments for t in named.choices[0].message.tool_calls]
    r = oc.responses.create(model=m, input="Weather in Paris?", tool_choice="required", max_output_tokens=300,
                            temperature=0, parallel_tool_calls=False, tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}])
    args += [item.arguments for item in r.output if item.type == "function_call"]
    ac = anthropic.Anthropic(base_url=served.base_url, api_key="none", max_retries=0)
    with ac.messages.stream(model=m, max_tokens=300, messages=ASK,
                            tool_choice={"type": "any", "disable_parallel_tool_use": True},
                            tools=[{"name": "get_weather", "input_schema": WEATHER}]) as s:
        msg = s.get_final_message()
    assert msg.stop_reason == "tool_use"
    args += [json.dumps(b.input) for b in msg.content if b.type == "tool_use"]
    assert len(args) == 5
    for a in args:
        jsonschema.validate(json.loads(a), WEATHER)
