"""Claude Code 2.1.197's recorded first request through the server with the official anthropic client's beta
namespace, sent as Claude Code sends it (/v1/messages?beta=true, the query set here as Claude Code's own client
sets it, with its anthropic-beta values), on a
random-weight Qwen3 in Qwen3's chat format: served streamed and not, counted by count_tokens as /v1/messages
renders it, its prompt served from the prefix cache by the next session (usage's cache_read_input_tokens), its
context_management edits and output_config honoured, and what ladle cannot honour refused by name."""
from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from ladle.entrypoints.openai.field_policy import BILLING_HEADER, KEEP_ALL_THINKING, MESSAGES_EFFORT
from server_harness import metric, recorded_client_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

RECORDED = json.loads((Path(__file__).resolve().parent / "fixtures" / "agent_requests"
                       / "claude-code-2.1.197.json").read_text())
BETAS = RECORDED["headers"]["anthropic-beta"].split(",")
NO_OPS = "ladle:no_op_fields_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = recorded_client_server(tmp_path_factory, "claude_code", RECORDED["body"]["model"])
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=600,
                               default_query={"beta": "true"})


def claude_code(session: str | None = None, **changes) -> dict:
    """The recorded body as the client's keyword arguments; max_tokens 8 (random weights would write all 32,000),
    the served model's name, and session: a text opening the system prompt, so no earlier test shares its prefix."""
    body = copy.deepcopy(RECORDED["body"])
    body.pop("stream")
    body["max_tokens"] = 8
    if session is not None:
        body["system"][1]["text"] = f"Session {session}. " + body["system"][1]["text"]
    return {**body, **changes}


def counted(client, body: dict) -> int:
    keys = ("model", "messages", "system", "tools", "tool_choice", "thinking", "context_management", "output_config")
    return client.beta.messages.count_tokens(**{k: v for k, v in body.items() if k in keys}, betas=BETAS).input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_the_recorded_request_is_served_and_count_tokens_counts_its_prompt(server, client, stream):
    body = claude_code()
    before = server.metrics()
    if stream:
        with client.beta.messages.stream(**body, betas=BETAS) as s:  # its accumulator checks every event
            events = list(s)
            msg = s.get_final_message()
        assert events[0].type == "message_start"
        start = events[0].message.usage
        assert start.input_tokens + start.cache_read_input_tokens == msg.usage.input_tokens + \
            msg.usage.cache_read_input_tokens
    else:
        msg = client.beta.messages.create(**body, betas=BETAS)
    assert msg.type == "message" and msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert 0 < msg.usage.output_tokens <= 8
    prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert prompt > 20_000 and counted(client, body) == prompt
    after = server.metrics()
    # output_config.effort too: Qwen3's template reads no reasoning_effort.
    for field in [BILLING_HEADER, KEEP_ALL_THINKING, MESSAGES_EFFORT, "messages[].content[].cache_control",
                  "system[].cache_control", "?beta=true"] + [f"anthropic-beta: {b}" for b in BETAS]:
        assert metric(after, NO_OPS, api="messages", field=field) == metric(before, NO_OPS, api="messages",
                                                                           field=field) + 1, field


def test_a_second_session_reads_the_system_prompt_and_tools_from_the_prefix_cache(client):
    """Two sessions differ in the billing line's hex (and a per-request hash): their prompts are the same tokens,
    so the second one's whole prompt but its last partial block comes from the cache, and says so."""
    session = uuid.uuid4().hex
    first = client.beta.messages.create(**claude_code(session), betas=BETAS)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens == 0
    second = claude_code(session)
    second["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.f0e; cc_entrypoint=sdk-cli; cch=1b2c;"
    with client.beta.messages.stream(**second, betas=BETAS) as s:
        start = next(iter(s))
        msg = s.get_final_message()
    prompt = first.usage.input_tokens
    assert start.type == "message_start" and start.message.usage.cache_read_input_tokens > 0
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt
    assert msg.usage.cache_read_input_tokens == start.message.usage.cache_read_input_tokens >= prompt - 64
    assert msg.usage.input_tokens == start.message.usage.input_tokens <= 64


def tool_turns(n: int) -> list[dict]:
    messages = [{"role": "user", "content": "go"}]
    for i in range(n):
        messages += [{"role": "assistant", "content": [
                          {"type": "thinking", "thinking": f"thinking about step {i} " * 20, "signature": "s"},
                          {"type": "tool_use", "id": f"toolu_{i}", "name": "Read", "input": {"file_path": f"/f{i}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                   "content": f"line {i} of the file\n" * 40}]}]
    return messages


def test_context_management_edits_change_the_prompt_count_tokens_sees(server, client):
    tools = RECORDED["body"]["tools"][:2]
    base = {"model": RECORDED["body"]["model"], "messages": tool_turns(3), "tools": tools,
            "thinking": {"type": "adaptive"}}

    def count(*edits: dict) -> int:
        return counted(client, {**base, "context_management": {"edits": list(edits)}})

    plain = counted(client, base)
    keep_all = count({"type": "clear_thinking_20251015", "keep": "all"})
    keep_two = count({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}})
    keep_one = count({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}})
    assert keep_all == plain and plain > keep_two > keep_one
    clear = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
             "keep": {"type": "tool_uses", "value": 1}}
    assert count(clear) < plain
    assert count({**clear, "trigger": {"type": "input_tokens", "value": plain}}) == plain  # not past its trigger
    assert count({**clear, "clear_at_least": {"type": "input_tokens", "value": plain}}) == plain  # saves too little
    assert count({**clear, "exclude_tools": ["Read"]}) == plain
    # keep "all" is taken without effect, and counted so.
    before = metric(server.metrics(), NO_OPS, api="messages", field=KEEP_ALL_THINKING)
    client.beta.messages.create(**base, max_tokens=2, betas=BETAS,
                                context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    assert metric(server.metrics(), NO_OPS, api="messages", field=KEEP_ALL_THINKING) == before + 1


def test_output_config_format_is_enforced_and_every_effort_is_taken(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    ask = [{"role": "user", "content": "Is it raining?"}]
    msg = client.beta.messages.create(model=RECORDED["body"]["model"], max_tokens=200, messages=ask,
                                      thinking={"type": "disabled"}, extra_body={"temperature": 0},
                                      output_config={"effort": "low", "format": {"type": "json_schema",
                                                                                 "schema": schema}})
    assert msg.stop_reason == "end_turn" and [b.type for b in msg.content] == ["text"]
    jsonschema.validate(json.loads(msg.content[0].text), schema)
    for effort in ("low", "medium", "high", "xhigh", "max"):
        counted(client, {"model": RECORDED["body"]["model"], "messages": ask, "output_config": {"effort": effort}})


def test_what_ladle_cannot_honour_is_a_400_naming_it(server):
    body = {"model": RECORDED["body"]["model"], "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({**body, "context_management": {"edits": [{"type": "compact_20260112"}]}}, {}, "compact_20260112"),
        ({**body, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": 3}]}}, {},
         "context_management.edits.0"),
        ({**body, "output_config": {"effort": "extreme"}}, {}, "output_config.effort"),
        ({**body, "output_config": {"task_budget": {"type": "tokens", "total": 10}}}, {}, "output_config.task_budget"),
        ({**body, "messages": body["messages"] + [{"role": "system", "content": "x", "output_config": {}}]}, {},
         "output_config"),
        (body, {"anthropic-beta": "files-api-2025-04-14"}, "'files-api-2025-04-14' is not a value"),
    ]
    for payload, headers, words in cases:
        for path in ("/v1/messages?beta=true", "/v1/messages/count_tokens?beta=true"):
            sent = {k: v for k, v in payload.items() if k != "max_tokens"} if "count" in path else payload
            r = httpx.post(server.base_url + path, json=sent, headers=headers, timeout=30)
            assert r.status_code == 400, (path, r.text)
            err = r.json()
            assert err["type"] == "error" and words in err["error"]["message"], (path, err)
    for path in ("/v1/messages?beta=true&stream=true", "/v1/messages/count_tokens?beta=false"):
        sent = {k: v for k, v in body.items() if k != "max_tokens"} if "count" in path else body
        r = httpx.post(server.base_url + path, json=sent, timeout=30)  # a query parameter would go unread
        assert r.status_code == 400 and "is not one this route takes" in r.json()["error"]["message"], r.text
