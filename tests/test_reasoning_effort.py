"""reasoning_effort (chat) and reasoning.effort (Responses) as the template's own controls
(ladle.entrypoints.openai.reasoning_effort): passed to a template that reads reasoning_effort, "none" turning a
thinking switch off, other grades on a switch-only template and every grade on a template with neither counted
as taken without effect; and chat completions' hint fields declared, counted, or refused by name."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from ladle.entrypoints.openai.chat.render import chat_prompt
from ladle.entrypoints.openai.field_policy import no_op_fields
from ladle.entrypoints.openai.protocol import ChatCompletionRequest
from ladle.entrypoints.openai.reasoning_effort import effort_kwargs, template_controls
from ladle.testing.tool_checkpoints import TEMPLATES

GRADES = ("none", "minimal", "low", "medium", "high", "xhigh")


class _Tokenizer:
    def __init__(self, template: object) -> None:
        self.chat_template = template


def test_the_template_says_which_controls_it_reads():
    qwen3 = (TEMPLATES / "qwen3.jinja").read_text()
    assert template_controls(_Tokenizer(qwen3), None) == {"enable_thinking"}
    assert template_controls(_Tokenizer(None), "Reasoning: {{ reasoning_effort }}") == {"reasoning_effort"}
    assert template_controls(_Tokenizer(qwen3), "{{ messages }}") == frozenset()  # --chat-template wins
    assert template_controls(_Tokenizer({"default": "{{ x }}", "tool_use": qwen3}), None) == {"enable_thinking"}
    assert template_controls(_Tokenizer(None), None) == frozenset()


@pytest.mark.parametrize("grade", GRADES)
def test_each_grade_reaches_the_control_the_template_has(grade):
    assert effort_kwargs(grade, frozenset({"reasoning_effort", "enable_thinking"})) == ({"reasoning_effort": grade},
                                                                                        False)
    switch = effort_kwargs(grade, frozenset({"enable_thinking"}))
    assert switch == ({"enable_thinking": grade != "none"}, grade != "none")  # the grade itself is dropped
    assert effort_kwargs(grade, frozenset()) == ({}, True)
    assert effort_kwargs(None, frozenset({"enable_thinking"})) == ({}, False)


def test_chat_prompt_maps_the_grade_and_the_clients_own_keywords_win():
    def kwargs(**body):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
        return chat_prompt(req, None, frozenset({"enable_thinking"})).kwargs

    assert kwargs(reasoning_effort="none") == {"enable_thinking": False}
    assert kwargs(reasoning_effort="xhigh") == {"enable_thinking": True}
    assert kwargs(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == {"enable_thinking": True}
    assert kwargs() == {}


def test_chat_hint_fields_are_counted_and_store_true_is_refused():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "k", "metadata": {"a": "b"},
        "service_tier": "flex", "verbosity": "low", "store": False, "reasoning_effort": "minimal"})
    assert no_op_fields("chat_completions", req) == ["metadata", "service_tier", "verbosity"]
    with pytest.raises(ValidationError, match="stores no completions"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "store": True})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                              "reasoning_effort": "maximum"})
