"""Codex CLI 0.171.0's recorded first request through /v1/responses, on a random-weight Qwen3 in Qwen3's chat
format: served streamed and not, its hints counted on /metrics, its prompt served from the prefix cache by the
next request (usage's cached_tokens), reasoning_tokens never above output_tokens. Custom tools (a forced call
held to a Lark grammar or a regex, its output item sent back), namespace tools (called and sent back under the
client's names, with the official openai client) and hosted tools (offered: left out and counted; required: a
400 naming the type)."""
from __future__ import annotations

import copy
import json
import re
import uuid
from pathlib import Path

import pytest

from ladle.entrypoints.openai.field_policy import hosted_tool
from server_harness import assert_error_envelope, metric, openai_client, recorded_client_server, sse_events

pytestmark = [pytest.mark.server, pytest.mark.slow]

RECORDED = json.loads((Path(__file__).resolve().parent / "fixtures" / "agent_requests"
                       / "codex-0.171.0.json").read_text())
NO_OPS = "ladle:no_op_fields_total"
# A grammar whose text needs JSON's escapes (quotes, backslashes, newlines), bounded so a random model ends it,
# and the same language as a Python regex
LINES = 'start: line{1,3}\nline: ("+" | "-") /[a-z"\\\\ ]{1,8}/ "\\n"\n'
LINES_RE = r'(?:[+-][a-z"\\ ]{1,8}\n){1,3}'
EDIT = {"type": "custom", "name": "edit", "description": "Edit the file.",
        "format": {"type": "grammar", "syntax": "lark", "definition": LINES}}
TICKET = {"type": "custom", "name": "ticket", "format": {"type": "grammar", "syntax": "regex",
                                                         "definition": "[A-Z]{2}-[0-9]{3}"}}
AGENTS = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn", "description": "Start a sub-agent.", "parameters": {
        "type": "object", "properties": {"task": {"type": "string", "maxLength": 8}}, "required": ["task"],
        "additionalProperties": False}}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = recorded_client_server(tmp_path_factory, "codex", RECORDED["body"]["model"])
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def codex(session: str | None = None, **changes) -> dict:
    """The recorded body; max_output_tokens 8 (random weights would write to the context's end), and session: a
    text opening the first developer message, so no earlier test shares its prefix past the tools."""
    body = copy.deepcopy(RECORDED["body"])
    body["max_output_tokens"] = 8
    if session is not None:
        first = body["input"][0]["content"][0]
        first["text"] = f"Session {session}. " + first["text"]
    return {**body, **changes}


def usage_holds(usage: dict) -> None:
    assert 0 <= usage["output_tokens_details"]["reasoning_tokens"] <= usage["output_tokens"], usage
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_the_recorded_request_is_served_streamed_and_not(server):
    before = server.metrics()
    r = server.post("/v1/responses", codex(stream=False), timeout=600)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
    assert {item["type"] for item in body["output"]} <= {"message", "function_call", "reasoning"}
    usage_holds(body["usage"])
    r = server.post("/v1/responses", codex(), timeout=600)  # stream: true, as recorded
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = sse_events(r.text.splitlines())
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed",
                                                                            "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    usage_holds(events[-1]["response"]["usage"])
    after = server.metrics()
    for field in ("include", "client_metadata", "reasoning.summary", hosted_tool("web_search")):
        counted = metric(after, NO_OPS, api="responses", field=field) - metric(before, NO_OPS, api="responses",
                                                                               field=field)
        assert counted == 2, field


def test_the_next_request_reads_the_prompt_from_the_prefix_cache(server):
    session = uuid.uuid4().hex
    first = server.post("/v1/responses", codex(session, stream=False), timeout=600).json()
    second = server.post("/v1/responses", codex(session, stream=False), timeout=600).json()
    cached = [u["usage"]["input_tokens_details"]["cached_tokens"] for u in (first, second)]
    assert cached[1] > cached[0] and cached[1] >= 0.9 * second["usage"]["input_tokens"], (cached, second["usage"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_custom_tool_call_holds_to_its_lark_grammar(client, stream):
    # effort none: Qwen3's template closes the thinking block, so the grammar holds from the first token
    kw = dict(model=RECORDED["body"]["model"], input="Fix the file.", tools=[EDIT, AGENTS],
              reasoning={"effort": "none"}, tool_choice={"type": "custom", "name": "edit"}, max_output_tokens=300,
              temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
        done = [e.input for e in events if e.type == "response.custom_tool_call_input.done"]
        assert done and deltas == done[0]
        r = events[-1].response
    else:
        r = client.responses.create(**kw)
    calls = [item for item in r.output if item.type == "custom_tool_call"]
    assert r.status == "completed" and calls, r.output
    for call in calls:
        assert call.name == "edit" and call.call_id and call.namespace is None
        assert re.fullmatch(LINES_RE, call.input), call.input
    usage_holds(r.usage.model_dump())


def test_custom_tool_calls_and_their_outputs_go_back(client):
    m = RECORDED["body"]["model"]
    first = client.responses.create(model=m, input="Open a ticket.", tools=[TICKET, EDIT], max_output_tokens=100,
                                    tool_choice={"type": "custom", "name": "ticket"}, temperature=0,
                                    reasoning={"effort": "none"})
    calls = [item for item in first.output if item.type == "custom_tool_call"]
    assert calls and all(re.fullmatch("[A-Z]{2}-[0-9]{3}", c.input) for c in calls), first.output
    items = [{"role": "user", "content": "Open a ticket."}] + [item.model_dump(exclude_none=True)
                                                               for item in first.output]
    items += [{"type": "custom_tool_call_output", "call_id": c.call_id, "output": "opened"} for c in calls]
    second = client.responses.create(model=m, input=items, tools=[TICKET, EDIT], max_output_tokens=8, temperature=0)
    assert second.status in ("completed", "incomplete")


def test_a_namespace_tool_is_called_and_sent_back_under_the_clients_names(server, client):
    m = RECORDED["body"]["model"]
    kw = dict(model=m, tools=[AGENTS, EDIT, {"type": "web_search"}], max_output_tokens=300, temperature=0,
              reasoning={"effort": "none"})
    first = client.responses.create(input="Delegate.", tool_choice={"type": "function", "name": "spawn",
                                                                    "namespace": "agents"}, **kw)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all((c.name, c.namespace) == ("spawn", "agents") for c in calls), first.output
    assert all(len(json.loads(c.arguments)["task"]) <= 8 for c in calls)
    items = [{"role": "user", "content": "Delegate."}] + [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "started"} for c in calls]
    items.append({"role": "user", "content": "Again."})
    second = client.responses.create(input=items, tool_choice={"type": "function", "name": "agents.spawn"}, **kw)
    assert [(c.name, c.namespace) for c in second.output if c.type == "function_call"][:1] == [("spawn", "agents")]


def test_hosted_tools_are_left_out_when_offered_and_refused_when_required(server):
    m = RECORDED["body"]["model"]
    before = server.metrics()
    r = server.post("/v1/responses", {"model": m, "input": "hi", "max_output_tokens": 4,
                                      "tools": [{"type": "web_search", "external_web_access": False},
                                                {"type": "file_search", "vector_store_ids": ["vs_1"]}]})
    assert r.status_code == 200, r.text
    after = server.metrics()
    for kind in ("web_search", "file_search"):
        assert metric(after, NO_OPS, api="responses", field=hosted_tool(kind)) == metric(
            before, NO_OPS, api="responses", field=hosted_tool(kind)) + 1
    for extra, says in (({"tool_choice": {"type": "web_search"}}, "tool_choice web_search"),
                        ({"tool_choice": "required"}, "web_search run only at OpenAI")):
        err = assert_error_envelope(server.post("/v1/responses", {"model": m, "input": "hi",
                                                                  "tools": [{"type": "web_search"}], **extra}),
                                    400, param="tool_choice")
        assert says in err["message"], err
    err = assert_error_envelope(server.post("/v1/responses", {"model": m, "input": "hi",
                                                              "tools": [{"type": "shell"}]}), 400, param="tools")
    assert "tool type 'shell'" in err["message"], err
