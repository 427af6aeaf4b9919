"""Llama 3.x JSON tool calls on recorded outputs: whole, and split at every character boundary into stream
deltas, they give the same content and calls; a call counts only at the start of the output (after whitespace or
<|python_tag|>), parallel calls are joined by "; "; arguments are the model's own JSON text and only grow; JSON
that is not a call stays content; the forced-call grammar validates and matches what the llama3_json chat
template renders, and nothing else."""
from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.hf as llguidance_hf
import pytest

from tool_format_checks import assert_arguments_only_grow, assert_whole_and_streamed_agree
from ladle.entrypoints.openai.chat.tool_parsers.base import ToolStream, parse_whole
from ladle.entrypoints.openai.chat.tool_parsers.llama3_json import Llama3JsonFormat

FMT = Llama3JsonFormat()
TEMPLATE = Path(__file__).parent.parent / "ladle" / "testing" / "chat_templates" / "llama3_json.jinja"
TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]},
         "noop": {"type": "object", "properties": {}}}

PARIS = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
NOOP = '{"name": "noop", "parameters": {}}'
# (output, content, [(name, arguments)])
OUTPUTS = [
    (PARIS, "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("<|python_tag|>" + PARIS, "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("\n " + PARIS + "\n", "", [("get_weather", {"city": "Paris", "days": 2})]),  # whitespace around
    (PARIS + "; " + NOOP + ";" + PARIS, "",
     [("get_weather", {"city": "Paris", "days": 2}), ("noop", {}), ("get_weather", {"city": "Paris", "days": 2})]),
    ('{"name": "get_weather", "arguments": {"city": "a \\"}\\" b {x}", "days": 1}}', "",
     [("get_weather", {"city": 'a "}" b {x}', "days": 1})]),  # "arguments"; braces and quotes in a string
    ('{"parameters": {"city": "Oslo"}, "name": "get_weather"}', "", [("get_weather", {"city": "Oslo"})]),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}', "", [("get_weather", {"city": "Rome"})]),  # cut off
    (PARIS + " Hope that helps.", " Hope that helps.", [("get_weather", {"city": "Paris", "days": 2})]),
    (PARIS + "; and more", "; and more", [("get_weather", {"city": "Paris", "days": 2})]),
    (PARIS + '; {"name": 3}', '; {"name": 3}', [("get_weather", {"city": "Paris", "days": 2})]),
    ("Let me check. " + PARIS, "Let me check. " + PARIS, []),  # a call after text is text
    ("Use <b>{x}</b>, then " + NOOP, "Use <b>{x}</b>, then " + NOOP, []),
    ('{"name": "John", "age": 3}', '{"name": "John", "age": 3}', []),  # JSON that is not a call
    ('{"a": [1, {"b": 2}]} then ' + PARIS, '{"a": [1, {"b": 2}]} then ' + PARIS, []),
    ('{"name": "get_weather", "param', '{"name": "get_weather", "param', []),  # cut off before the arguments
    ("{not json}", "{not json}", []),
    ("<|python_tag|>brave_search.call(query='x')", "<|python_tag|>brave_search.call(query='x')", []),  # built-in
    ("<|python_ta", "<|python_ta", []),  # a tag cut off is text
    ("plain answer,\nno calls ", "plain answer,\nno calls ", []),
]


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_whole_and_streamed_agree(text, content, calls):
    assert_whole_and_streamed_agree(FMT, text, content, calls, TOOLS)


@pytest.mark.parametrize("text", [t for t, _, calls in OUTPUTS if calls])
def test_arguments_only_grow_and_end_as_json(text):
    end = FMT.region_end(text)
    region = text if end is None else text[:end]
    assert_arguments_only_grow(FMT, region, TOOLS)


def test_arguments_stream_as_the_model_writes_them():
    stream = ToolStream(FMT, TOOLS)
    pieces = [d for ch in PARIS for d in stream.feed(ch).tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].id and pieces[0].arguments == "{"
    assert len(pieces) > 10 and "".join(p.arguments for p in pieces) == '{"city": "Paris", "days": 2}'


def test_content_streams_one_character_behind():
    stream = ToolStream(FMT, TOOLS)
    sent = [stream.feed(ch).content for ch in "Hi there {"]
    assert sent == ["", "H", "", "i ", "t", "h", "e", "r", "", ""]  # whitespace and "{" wait for a mark
    assert stream.finish().content == "e {"


def render(calls: list[tuple[str, dict]], tokenizer) -> str:
    """The assistant turn the llama3_json template renders: the text a model trained on it writes."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE.read_text(), tokenize=False)
    return text.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[-1].split("<|eot_id|>")[0]


def test_template_rendering_parses_back(tokenizer):
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("noop", {})]
    text = render(calls, tokenizer)
    assert text == PARIS + "; " + NOOP
    content, got = parse_whole(FMT, text, TOOLS)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert [c.arguments for c in got] == ['{"city": "Paris", "days": 2}', "{}"]  # the model's own text


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammar_compiles_and_matches_the_format(parallel, tokenizer):
    grammar = llguidance.grammar_from("grammar", FMT.grammar(TOOLS, parallel))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    lltok = llguidance_hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    cases = [
        (PARIS, True),
        (NOOP, True),
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', True),  # an optional argument left out
        (PARIS + "; " + NOOP, parallel),  # a second call
        ('{"name": "other", "parameters": {}}', False),  # a name no tool has
        ('{"name": "get_weather", "parameters": {"days": 2}}', False),  # a required argument missing
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": "2"}}', False),  # the wrong type
        ('{"name": "noop", "arguments": {}}', False),  # the grammar writes Llama's key
        ("Sure. " + NOOP, False),
    ]
    for text, ok in cases:
        m = llguidance.LLMatcher(lltok, grammar)
        assert (m.consume_tokens(tokenizer.encode(text)) and m.is_accepting()) == ok, text
