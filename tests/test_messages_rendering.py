"""Anthropic Messages requests as agents send them, rendered to prompts (no server): Claude Code 2.1.197's recorded
first request in every family's template, its mid-conversation system message where it stands (in place, or folded
into the message before it where the template cannot place one), the billing line kept out of the prompt, turns that
only append, context_management edits, output_config and deferred tools."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ladle.demo import build_tokenizer
from ladle.entrypoints.openai.anthropic.context_edits import (
    CLEARED_RESULT, clear_thinking, clear_tool_uses, keeps_all_thinking, triggered,
)
from ladle.entrypoints.openai.anthropic.protocol import ClearToolUsesEdit, MessagesRequest
from ladle.entrypoints.openai.anthropic.serving import to_chat
from ladle.entrypoints.openai.chat.render import chat_prompt, render
from ladle.entrypoints.openai.chat.serving import chat_request
from ladle.entrypoints.openai.field_policy import BILLING_HEADER, KEEP_ALL_THINKING
from ladle.testing.tool_checkpoints import FAMILIES, TEMPLATES, build_tool_checkpoint

RECORDED = Path(__file__).resolve().parent / "fixtures" / "agent_requests" / "claude-code-2.1.197.json"
# family -> whether its template renders a system message mid-conversation (else it is folded)
IN_PLACE = {"qwen3": True, "qwen3_5": False, "deepseek_v4": False, "llama3": True}
MID_SYSTEM_OPENER = {"qwen3": "<|im_start|>system\n", "llama3": "<|start_header_id|>system<|end_header_id|>\n\n"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for family, (template, tokens) in FAMILIES.items():
        out[family] = build_tokenizer(tmp_path_factory.mktemp(family), added_tokens=tokens,
                                      chat_template=(TEMPLATES / template).read_text())
    return out


def recorded() -> dict:
    return json.loads(RECORDED.read_text())["body"]


def rendered(tok, body: dict, generation_prompt: bool = True) -> tuple[list[int], str]:
    req = MessagesRequest.model_validate(body)
    chat, _ = to_chat(req, list(req.messages), req.max_tokens, False)
    prompt = chat_prompt(chat, None)
    prompt = prompt if generation_prompt else type(prompt)(prompt.messages, prompt.tools, prompt.kwargs,
                                                           prompt.template, False)
    ids, _, text = render(tok, prompt, False)
    return ids, text


@pytest.mark.parametrize("family", sorted(IN_PLACE))
def test_the_recorded_mid_conversation_system_message_renders_where_it_stands(tokenizers, family):
    body = recorded()
    system_text = body["messages"][1]["content"]
    _, text = rendered(tokenizers[family], body)
    user = text.index("say hi")
    at = text.index(system_text)
    assert user < at and text.count(system_text) == 1  # after the user message it follows, never hoisted
    assert "x-anthropic-billing-header" not in text and "cc_version" not in text
    assert text.index("You are a Claude agent") < user
    between = text[user + len("say hi"):at]
    if IN_PLACE[family]:
        assert between.endswith(MID_SYSTEM_OPENER[family])  # a system turn of its own
    else:
        assert between == "\n\n"  # folded into the user message before it


def test_the_billing_line_is_taken_as_a_no_op_and_two_sessions_render_the_same_tokens(tokenizers):
    a, b = recorded(), recorded()
    b["system"][0]["text"] = b["system"][0]["text"].replace("2.1.197.123", "2.1.197.f0e") + " cch=9a8b7c;"
    assert a != b
    for tok in tokenizers.values():
        assert rendered(tok, a)[0] == rendered(tok, b)[0]
    req = MessagesRequest.model_validate(a)
    assert to_chat(req, list(req.messages), 8, False)[1] == [BILLING_HEADER]


@pytest.mark.parametrize("family", sorted(IN_PLACE))
def test_a_turn_with_a_trailing_system_message_only_appends(tokenizers, family):
    """Turn 2 carries turn 1 unchanged (its system message included), the reply, a new user message and a new
    system message: its prompt starts with turn 1's, so every earlier token can come from the prefix cache."""
    tok = tokenizers[family]
    turn1 = recorded()
    turn2 = copy.deepcopy(turn1)
    turn2["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": "Hi there."}]},
                          {"role": "user", "content": "list the files"},
                          {"role": "system", "content": "Reminder: the date is 2026-12-07."}]
    first, first_text = rendered(tok, turn1, generation_prompt=False)
    second, text = rendered(tok, turn2)
    assert text.startswith(first_text)
    assert text.index("list the files") < text.index("Reminder: the date")
    if family != "llama3":  # this test tokenizer has no <|eot_id|> token, so BPE merges across the turn's end
        assert second[:len(first)] == first


def test_clear_at_next_user_message_hides_a_system_message_once_a_user_message_follows(tokenizers):
    body = recorded()
    body["messages"][1]["clear_at"] = "next_user_message"
    tok, system_text = tokenizers["qwen3"], body["messages"][1]["content"]
    assert system_text in rendered(tok, body)[1]
    body["messages"].append({"role": "user", "content": "and now?"})
    assert system_text not in rendered(tok, body)[1]


def thinking_turns(n: int) -> list[dict]:
    """A user question and n assistant turns, each thinking and calling a tool, each answered."""
    messages = [{"role": "user", "content": "go"}]
    for i in range(n):
        messages += [{"role": "assistant", "content": [
                          {"type": "thinking", "thinking": f"THOUGHT-{i}", "signature": "s"},
                          {"type": "tool_use", "id": f"toolu_{i}", "name": "Read", "input": {"file_path": f"/f{i}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                   "content": f"RESULT-{i}"}]}]
    return messages


def edited(tok, body: dict) -> tuple[str, list[str]]:
    """The rendered text after body's clear_thinking edits (which need no token counts), and the no-ops taken."""
    req = MessagesRequest.model_validate(body)
    messages, taken = list(req.messages), []
    for edit in req.context_management.edits:
        taken += [KEEP_ALL_THINKING] if keeps_all_thinking(edit) else []
        messages = clear_thinking(messages, edit)
    chat, _ = to_chat(req, messages, 8, False)
    return render(tok, chat_prompt(chat, None), False)[2], taken


@pytest.mark.parametrize("keep, kept", [({"type": "thinking_turns", "value": 1}, [2]),
                                        ({"type": "thinking_turns", "value": 2}, [1, 2]),
                                        ({"type": "thinking_turns", "value": 0}, []),
                                        (None, [2]),  # Anthropic's default: the last turn
                                        ("all", [0, 1, 2]), ({"type": "all"}, [0, 1, 2])])
def test_clear_thinking_keeps_the_thinking_of_the_last_turns(tokenizers, keep, kept):
    edit = {"type": "clear_thinking_20251015", **({"keep": keep} if keep is not None else {})}
    body = {"model": "m", "max_tokens": 8, "messages": thinking_turns(3), "context_management": {"edits": [edit]}}
    text, taken = edited(tokenizers["qwen3"], body)  # Qwen3's shows each turn's thinking after the last user text
    assert [i for i in range(3) if f"THOUGHT-{i}" in text] == kept
    assert all(f"RESULT-{i}" in text for i in range(3))
    assert taken == ([KEEP_ALL_THINKING] if keep in ("all", {"type": "all"}) else [])


def test_clear_tool_uses_replaces_old_results_past_its_trigger():
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": thinking_turns(4)})
    messages = list(req.messages)

    def results(edit: dict) -> list[str]:
        e = ClearToolUsesEdit.model_validate({"type": "clear_tool_uses_20250919", **edit})
        out = clear_tool_uses(messages, e)
        return [b.text() for m in out if m.role == "user" and isinstance(m.content, list) for b in m.content]

    edit = {"trigger": {"type": "tool_uses", "value": 2}, "keep": {"type": "tool_uses", "value": 1}}
    assert triggered(ClearToolUsesEdit.model_validate({"type": "clear_tool_uses_20250919", **edit}), messages, None)
    assert results(edit) == [CLEARED_RESULT] * 3 + ["RESULT-3"]
    assert results({**edit, "keep": {"type": "tool_uses", "value": 3}}) == [CLEARED_RESULT, "RESULT-1", "RESULT-2",
                                                                           "RESULT-3"]
    assert results({**edit, "exclude_tools": ["Read"]}) == [f"RESULT-{i}" for i in range(4)]
    e = ClearToolUsesEdit.model_validate({"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses",
                                                                                          "value": 4}})
    assert not triggered(e, messages, None)  # four calls are not past a trigger of four
    assert triggered(ClearToolUsesEdit.model_validate({"type": "clear_tool_uses_20250919"}), messages, 100_001)
    assert not triggered(ClearToolUsesEdit.model_validate({"type": "clear_tool_uses_20250919"}), messages, 100_000)
    inputs = clear_tool_uses(messages, ClearToolUsesEdit.model_validate(
        {"type": "clear_tool_uses_20250919", "clear_tool_inputs": True}))
    assert [b.input for m in inputs if m.role == "assistant" for b in m.content if b.type == "tool_use"] == [
        {}, {"file_path": "/f1"}, {"file_path": "/f2"}, {"file_path": "/f3"}]  # the default keeps the last 3


def test_output_config_reaches_the_template_and_the_constraint(tokenizers):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"effort": "max", "format": {"type": "json_schema", "schema": {"type": "object"}}},
            "thinking": {"type": "adaptive"}}
    req = MessagesRequest.model_validate(body)
    chat, _ = to_chat(req, list(req.messages), 8, False)
    assert chat.chat_template_kwargs == {"enable_thinking": True, "thinking": True, "reasoning_effort": "max"}
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {
        "type": "object"}
    effort = "{{ messages[0].content }} effort={{ reasoning_effort }}"
    _, _, text = render(tokenizers["qwen3"], chat_prompt(chat, effort), False)
    assert text == "hi effort=max"


def test_a_deferred_tool_is_out_of_the_prompt_until_a_tool_reference_loads_it(tokenizers):
    tools = [{"name": "Search", "input_schema": {"type": "object"}, "description": "find tools"},
             {"name": "Deploy", "input_schema": {"type": "object"}, "description": "DEPLOY-TOOL",
              "defer_loading": True, "strict": True}]
    ask = [{"role": "user", "content": "deploy it"}]
    body = {"model": "m", "max_tokens": 8, "tools": tools, "messages": ask}
    _, text = rendered(tokenizers["qwen3"], body)
    assert "find tools" in text and "DEPLOY-TOOL" not in text
    body["messages"] = ask + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Search", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "tool_reference", "tool_name": "Deploy"}]}]}]
    _, text = rendered(tokenizers["qwen3"], body)
    assert "DEPLOY-TOOL" in text and '"strict"' not in text


def test_the_offline_llm_chat_places_a_later_system_message_as_the_server_does(tmp_path):
    from ladle import LLM, SamplingParams

    llm = LLM(build_tool_checkpoint(tmp_path, "qwen3_5"))  # Qwen3.5's template drops a later system message
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "NOTE"}]
    out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    served = render(llm.get_tokenizer(), chat_prompt(chat_request({"messages": messages}), None), False)[2]
    assert out.prompt == served and "hi\n\nNOTE<|im_end|>" in out.prompt
