"""The no-op request fields (ladle.entrypoints.openai.field_policy): found where a request sets them, found only
there, and listed in the README's table exactly."""
from __future__ import annotations

from pathlib import Path

import pytest

from ladle.entrypoints.openai.anthropic.protocol import MessagesRequest
from ladle.entrypoints.openai.field_policy import NO_OPS, header_no_ops, no_op_fields, query_no_ops
from ladle.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_table_lists_every_no_op_and_nothing_else():
    text = README.read_text()
    start = text.index("| API | field | why it changes nothing |")
    lines = text[start:].splitlines()[2:]
    rows = lines[:next((i for i, line in enumerate(lines) if not line.startswith("| ")), len(lines))]
    assert rows == [f"| {n.api} | `{n.path}` | {n.why} |" for n in NO_OPS]


def test_no_ops_are_found_where_a_request_sets_them():
    cc = {"type": "ephemeral"}
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8, "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "s", "cache_control": cc}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": cc}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": cc}]}]})
    assert no_op_fields("messages", req) == ["messages[].content[].cache_control", "system[].cache_control",
                                             "tools[].cache_control"]
    plain = MessagesRequest.model_validate({"model": "m", "max_tokens": 8,
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert no_op_fields("messages", plain) == []
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "user": "u"})
    assert no_op_fields("chat_completions", chat) == ["user"] and no_op_fields("messages", chat) == []


def test_every_no_op_names_a_field_its_api_declares():
    """A path in the table that no request model has would be a row counting nothing."""
    from ladle.entrypoints.openai.protocol import CompletionRequest
    from ladle.entrypoints.openai.responses.protocol import ResponsesRequest

    models = {"chat_completions": ChatCompletionRequest, "completions": CompletionRequest,
              "messages": MessagesRequest, "responses": ResponsesRequest}
    for n in NO_OPS:
        if n.kind in ("header", "query"):
            continue
        model, parts = models[n.api], n.path.split("=")[0].replace("[]", "").split(".")  # a value names its field
        for i, part in enumerate(parts[:-1]):
            annotation = model.model_fields[part].annotation
            model = next(t for t in _types(annotation) if isinstance(t, type) and hasattr(t, "model_fields")
                         and parts[i + 1] in t.model_fields)
        assert parts[-1] in model.model_fields, n


def test_header_values_are_no_ops_by_name_and_others_are_refused():
    assert header_no_ops("messages", "anthropic-beta", " effort-2025-11-24,claude-code-20250219 ,") == [
        "anthropic-beta: claude-code-20250219", "anthropic-beta: effort-2025-11-24"]
    assert header_no_ops("messages", "anthropic-beta", None) == []
    with pytest.raises(OpenAIError, match="'files-api-2025-04-14' is not a value this server knows"):
        header_no_ops("messages", "anthropic-beta", "effort-2025-11-24,files-api-2025-04-14")


def test_query_parameters_are_no_ops_by_name_and_others_are_refused():
    assert query_no_ops("messages", {"beta": "true"}) == ["?beta=true"]
    assert query_no_ops("chat_completions", {}) == []
    with pytest.raises(OpenAIError, match="query parameter 'beta'='false' is not one this route takes"):
        query_no_ops("messages", {"beta": "false"})
    with pytest.raises(OpenAIError, match="'api-version'"):
        query_no_ops("chat_completions", {"api-version": "2024-10-21"})


def _types(annotation):
    import typing

    out, todo = [], [annotation]
    while todo:
        t = todo.pop()
        args = typing.get_args(t)
        if args:
            todo.extend(args)
        else:
            out.append(t)
    return out
