"""The Responses API's tools and items as the chat layer serves them (ladle.entrypoints.openai.responses.tools,
responses.serving.to_chat, responses.stream): Codex's recorded request read whole (namespace tools flattened,
web_search left out and counted, its hint fields counted), custom tools shown as one string parameter,
calls sent back under the client's names, custom tool calls streamed as their decoded input, what cannot be
served a 400 naming it, and reasoning_tokens counting generated tokens."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from ladle.entrypoints.openai.chat.output import ChoicePiece
from ladle.entrypoints.openai.chat.reasoning_parser import PARSERS, thinking_tokens
from ladle.entrypoints.openai.chat.tool_parsers.base import ToolCallDelta
from ladle.entrypoints.openai.field_policy import NO_OPS, hosted_tool, no_op_fields
from ladle.entrypoints.openai.protocol_base import OpenAIError
from ladle.entrypoints.openai.responses.protocol import ResponsesRequest
from ladle.entrypoints.openai.responses.serving import to_chat
from ladle.entrypoints.openai.responses.stream import ResponsesWriter
from ladle.entrypoints.openai.responses.tools import ClientTool, InputStream, custom_input, responses_tools

CODEX = json.loads((Path(__file__).resolve().parent / "fixtures" / "agent_requests" / "codex-0.171.0.json")
                   .read_text())["body"]
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /.+/'}}
CODE = {"type": "custom", "name": "code", "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+"}}
AGENTS = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn", "description": "Start one.", "parameters": {"type": "object"}},
    {"type": "custom", "name": "note"}]}


def request(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **body})


def test_codex_recorded_request_is_read_whole():
    req = ResponsesRequest.model_validate(CODEX)
    tools = responses_tools(req.tools)
    chat = to_chat(req, tools)
    names = [t.function.name for t in chat.tools]
    assert names[:4] == ["exec_command", "write_stdin", "request_user_input", "view_image"]
    assert "multi_agent_v1.spawn_agent" in names and len(names) == 12  # 7 functions and 5 of the namespace
    assert tools.hosted == ["web_search"] and chat.tool_choice == "auto" and chat.parallel_tool_calls
    assert tools.client("multi_agent_v1.spawn_agent") == ClientTool("spawn_agent", "multi_agent_v1")
    spawn = next(t for t in chat.tools if t.function.name == "multi_agent_v1.spawn_agent").function
    assert spawn.description.startswith("Tools for spawning and managing sub-agents.\n\n")
    assert [m.role for m in chat.messages] == ["system", "system", "user", "user"]
    assert no_op_fields("responses", req) == ["client_metadata", "include", "reasoning.summary"]
    assert hosted_tool("web_search") in {n.path for n in NO_OPS}


def test_custom_tools_are_functions_of_one_string():
    tools = responses_tools(request(tools=[PATCH, CODE, AGENTS]).tools)
    shown = {f["function"]["name"]: f["function"] for f in tools.functions}
    patch = shown["apply_patch"]["parameters"]
    assert patch["required"] == ["input"] and patch["properties"]["input"]["type"] == "string"
    assert 'start: "*** Begin Patch" /.+/' in patch["properties"]["input"]["description"]
    assert shown["code"]["parameters"]["properties"]["input"]["pattern"] == "^(?:[0-9]+)$"
    assert "pattern" not in shown["agents.note"]["parameters"]["properties"]["input"]
    assert shown["agents.spawn"]["description"] == "Sub-agents.\n\nStart one."
    assert tools.grammars == {"apply_patch": PATCH["format"]["definition"]}  # the regex is the schema's pattern
    assert tools.client("agents.note") == ClientTool("note", "agents", custom=True)
    assert custom_input('{"input": "a\\nb"}') == "a\nb" and custom_input('{"x": 1}') == '{"x": 1}'
    assert custom_input('{"input": "\\ud800\\ud83d\\ude00"}') == "\ufffd\U0001F600"  # a lone half: replaced


def test_calls_sent_back_are_shown_under_the_names_the_model_knows():
    items = [{"role": "user", "content": "go"},
             {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "agents", "arguments": "{}"},
             {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch x"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}],
              "encrypted_content": None},
             {"type": "function_call_output", "call_id": "c1", "output": "started"},
             {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]}]
    req = request(input=items, tools=[PATCH, AGENTS])
    chat = to_chat(req, responses_tools(req.tools))
    call = chat.messages[1].tool_calls
    assert [(c.function.name, c.function.arguments) for c in call] == [
        ("agents.spawn", "{}"), ("apply_patch", json.dumps({"input": "*** Begin Patch x"}))]
    assert [(m.role, m.tool_call_id, m.content) for m in chat.messages[2:]] == [("tool", "c1", "started"),
                                                                               ("tool", "c2", "ok")]
    bad = request(input=[{"type": "custom_tool_call_output", "call_id": "c9", "output": "x"}], tools=[PATCH])
    with pytest.raises(OpenAIError, match="no tool call found for custom_tool_call_output with call_id 'c9'"):
        to_chat(bad, responses_tools(bad.tools))


@pytest.mark.parametrize("choice,expected", [
    ({"type": "custom", "name": "apply_patch"}, {"type": "function", "function": {"name": "apply_patch"}}),
    ({"type": "function", "name": "spawn", "namespace": "agents"},
     {"type": "function", "function": {"name": "agents.spawn"}}),
    ({"type": "function", "name": "agents.spawn"}, {"type": "function", "function": {"name": "agents.spawn"}}),
    ("required", "required"),
])
def test_tool_choice_names_tools_as_the_client_does(choice, expected):
    req = request(tools=[PATCH, AGENTS, {"type": "web_search"}], tool_choice=choice)
    got = to_chat(req, responses_tools(req.tools)).tool_choice
    assert (got if isinstance(got, str) else got.model_dump()) == expected


@pytest.mark.parametrize("body,message", [
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice web_search: a tool"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}], "tool_choice": "required"},
     "needs a tool this server can call (file_search run only at OpenAI)"),
    ({"tools": [PATCH], "tool_choice": {"type": "function", "name": "apply_patch"}},
     "names the function tool 'apply_patch', which is not among"),
    ({"tools": [AGENTS, {"type": "function", "name": "agents.spawn"}]}, "a second tool named 'agents.spawn'"),
    ({"tools": [{**AGENTS, "name": "n" * 60}]}, "longer than the 64 characters"),
])
def test_what_cannot_be_served_is_a_400_naming_it(body, message):
    req = request(**body)
    with pytest.raises(OpenAIError, match=re.escape(message)):
        to_chat(req, responses_tools(req.tools))


def test_hosted_tools_offered_are_left_out_and_an_unknown_type_is_named():
    req = request(tools=[{"type": "web_search", "external_web_access": False}, {"type": "mcp", "server_label": "x"}])
    tools = responses_tools(req.tools)
    assert tools.functions == [] and tools.hosted == ["web_search", "mcp"]
    assert to_chat(req, tools).tools is None and to_chat(req, tools).tool_choice is None
    for tool, named in (({"type": "shell"}, "tool type 'shell' is not one this server knows"),
                        ({"name": "x"}, "a tool needs a type")):
        with pytest.raises(ValidationError, match=named):
            request(tools=[tool])
    with pytest.raises(ValidationError, match="tool_choice of type 'allowed_tools'"):
        request(tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []})
    with pytest.raises(ValidationError, match="encrypts nothing|issues no encrypted reasoning"):
        request(input=[{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}])


def test_a_custom_tool_call_streams_its_decoded_input():
    text = 'line "one"\n\tline \\two\\ \u00e9\U0001F600'
    arguments = json.dumps({"input": text})
    for cut in range(1, len(arguments)):
        stream = InputStream()
        assert stream.feed(arguments[:cut]) + stream.feed(arguments) == text
    clients = {"p": ClientTool("apply_patch", custom=True), "ns.f": ClientTool("f", "ns")}
    writer = ResponsesWriter(lambda status, output, usage: {"status": status, "output": output},
                             lambda name: clients[name])
    pieces = [ChoicePiece(tool_calls=[ToolCallDelta(0, "call_1", "p", arguments[:9])])]
    pieces += [ChoicePiece(tool_calls=[ToolCallDelta(0, arguments=arguments[i:i + 5])])
               for i in range(9, len(arguments), 5)]
    pieces.append(ChoicePiece(tool_calls=[ToolCallDelta(1, "call_2", "ns.f", '{"a": 1}')]))
    events = [json.loads(e.split("data: ", 1)[1]) for p in pieces for e in writer.take(p)]
    events += [json.loads(e.split("data: ", 1)[1]) for e in writer.finish("completed", {})]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
    done = next(e for e in events if e["type"] == "response.custom_tool_call_input.done")
    assert deltas == done["input"] == text
    output = events[-1]["response"]["output"]
    assert output[0]["type"] == "custom_tool_call" and output[0]["input"] == text and output[0]["name"] == "apply_patch"
    assert output[1]["type"] == "function_call" and (output[1]["name"], output[1]["namespace"]) == ("f", "ns")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_reasoning_tokens_count_generated_tokens():
    texts = {1: "<think>", 2: "a", 3: "b", 4: "</think>", 5: "\n\n", 6: "answer", 7: " more"}
    parser = PARSERS["qwen3"]
    assert thinking_tokens(parser, False, [1, 2, 3, 4, 5, 6, 7], texts.__getitem__) == 4
    assert thinking_tokens(parser, True, [2, 3, 4, 6], texts.__getitem__) == 3  # the prompt opened the block
    assert thinking_tokens(parser, True, [2, 3, 2], texts.__getitem__) == 3  # cut off while thinking: all of it
    assert thinking_tokens(parser, False, [6, 1, 2], texts.__getitem__) == 0  # a tag inside the answer is text
