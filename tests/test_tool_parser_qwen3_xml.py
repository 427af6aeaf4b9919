"""Qwen3.5 / Qwen3-Coder XML tool calls on recorded outputs: whole, and split at every character boundary into
stream deltas, they give the same content and calls; values are typed by the tool's schema; arguments only grow,
one complete parameter at a time; malformed regions stay content; the forced-call grammar validates and matches
what the qwen35 chat template renders, and nothing else."""
from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.hf as llguidance_hf
import pytest

from tool_format_checks import assert_whole_and_streamed_agree
from ladle.entrypoints.openai.chat.tool_parsers.base import ToolStream, parse_whole
from ladle.entrypoints.openai.chat.tool_parsers.qwen3_xml import Qwen3XmlFormat, convert

FMT = Qwen3XmlFormat()
TEMPLATE = Path(__file__).parent.parent / "ladle" / "testing" / "chat_templates" / "qwen35_xml.jinja"
TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                         "required": ["city"]},
         "configure": {"type": "object", "properties": {
             "ratio": {"type": "number"}, "enabled": {"type": "boolean"},
             "options": {"type": "object", "properties": {"depth": {"type": "integer"}}},
             "tags": {"type": "array", "items": {"type": "string"}}, "note": {"type": "string"},
             "limit": {"type": ["integer", "null"]}, "mode": {"type": "string", "enum": ["fast", "safe"]}},
             "required": ["ratio"]},
         "noop": {"type": "object", "properties": {}}}


def call(name: str, **params: str) -> str:
    """One call as the model writes it (values already rendered as text)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS = call("get_weather", city="Paris", days="2")
# (output, content, [(name, arguments)])
OUTPUTS = [
    (PARIS, "", [("get_weather", {"city": "Paris", "days": 2})]),
    (PARIS + "\n" + call("noop"), "", [("get_weather", {"city": "Paris", "days": 2}), ("noop", {})]),
    ("Let me check.\n\n" + PARIS, "Let me check.\n\n", [("get_weather", {"city": "Paris", "days": 2})]),
    (call("configure", ratio="0.5", enabled="True", options='{"depth": 3}', tags='["a", "b"]',
          note="line one\nline two\n", limit="None", mode="fast"), "",
     [("configure", {"ratio": 0.5, "enabled": True, "options": {"depth": 3}, "tags": ["a", "b"],
                     "note": "line one\nline two\n", "limit": None, "mode": "fast"})]),
    (call("configure", ratio="3.0", enabled="false", options="{'depth': 1}", note="null"), "",
     [("configure", {"ratio": 3, "enabled": False, "options": {"depth": 1}, "note": "null"})]),  # Python literal
    (call("get_weather", city="Oslo", days="two", units="metric", hours="5"), "",  # failed conversion, unknown
     [("get_weather", {"city": "Oslo", "days": "two", "units": "metric", "hours": "5"})]),
    (call("configure", ratio="nan", options="{not json"), "",
     [("configure", {"ratio": "nan", "options": "{not json"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n</function>\n"
     "</tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),  # a </parameter> missing
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</param", "",
     [("get_weather", {"city": "Rome"})]),  # the output ended inside the region
    ("<tool_call>\n<function=noop>", "", [("noop", {})]),
    ("<tool_call>\n<function=get_wea", "<tool_call>\n<function=get_wea", []),  # no whole name: content
    ("<tool_call>\nnot a call\n</tool_call> and text", "<tool_call>\nnot a call\n</tool_call> and text", []),
    ("<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
     "<tool_call>\n<function=get weather>\n</function>\n</tool_call>", []),  # a phantom name
    ("Text that mentions <tool_call", "Text that mentions <tool_call", []),  # a tag cut off is text
    ("plain answer, no calls", "plain answer, no calls", []),
]


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_whole_and_streamed_agree(text, content, calls):
    assert_whole_and_streamed_agree(FMT, text, content, calls, TOOLS)


@pytest.mark.parametrize("text", [t for t, _, calls in OUTPUTS if calls])
def test_arguments_only_grow_and_end_as_json(text):
    region = text[text.find(FMT.start):]
    end = FMT.region_end(region)
    region = region if end is None else region[:end]
    seen: list[str] = []
    for i in range(len(FMT.start), len(region) + 1):
        got = FMT.progress(region[:i], TOOLS, final=False)
        assert got is not None and len(got) <= 1
        if got and got[0].name is not None:
            assert not seen or got[0].arguments.startswith(seen[-1])
            seen.append(got[0].arguments)
    final = FMT.progress(region, TOOLS, final=True)
    assert final and final[0].done and final[0].arguments.startswith(seen[-1] if seen else "")
    assert isinstance(json.loads(final[0].arguments), dict)


def test_arguments_stream_one_whole_parameter_at_a_time():
    stream = ToolStream(FMT, TOOLS)
    pieces = [d for ch in PARIS for d in stream.feed(ch).tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].id
    assert [p.arguments for p in pieces] == ["{", '"city": "Paris"', ', "days": 2', "}"]


def test_values_are_typed_by_schema():
    assert convert("42", {"type": "integer"}) == 42
    assert convert("2.5", {"type": "number"}) == 2.5 and convert("4", {"type": "number"}) == 4
    assert convert("TRUE", {"type": "boolean"}) is True and convert("no", {"type": "boolean"}) is False
    assert convert("null", {"type": "integer"}) is None
    assert convert("null", {"type": "string"}) == "null" and convert("null", {"type": ["string", "null"]}) is None
    assert convert("7", {"anyOf": [{"type": "null"}, {"type": "integer"}]}) == 7
    assert convert("[1, 2]", {"type": "array"}) == [1, 2]
    assert convert("{1, 2}", {"type": "array"}) == "{1, 2}"  # a Python set has no JSON
    assert convert("12", {}) == "12" and convert("12", None) == "12"  # no type, unknown parameter: raw text


def render(calls: list[tuple[str, dict]], tokenizer) -> str:
    """The assistant turn the qwen35 template renders for these calls: the text a model trained on it writes."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE.read_text(), tokenize=False)
    return text.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]


def test_template_rendering_parses_back(tokenizer):
    calls = [("get_weather", {"city": "Paris", "days": 2}),
             ("configure", {"ratio": 0.25, "enabled": True, "options": {"depth": 2}, "tags": ["x"], "limit": None})]
    text = render(calls, tokenizer)
    assert text.startswith(call("get_weather", city="Paris", days="2") + "\n<tool_call>")
    content, got = parse_whole(FMT, text, TOOLS)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammar_compiles_and_matches_the_format(parallel, tokenizer):
    grammar = llguidance.grammar_from("grammar", FMT.grammar(TOOLS, parallel))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    lltok = llguidance_hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    paris = render([("get_weather", {"city": "Paris", "days": 2})], tokenizer)
    config = render([("configure", {"ratio": 1.5, "enabled": False, "options": {"depth": 1}, "tags": ["a"],
                                    "note": "two\nlines", "limit": None, "mode": "safe"})], tokenizer)
    cases = [(paris, True), (config, True), (render([("noop", {})], tokenizer), True),
             (render([("get_weather", {"city": "Oslo"})], tokenizer), True),  # an optional parameter left out
             (paris + "\n" + config, parallel),
             (paris.replace("get_weather", "get_weathers"), False),  # no such function
             (render([("get_weather", {"days": 2})], tokenizer), False),  # a required parameter missing
             (render([("get_weather", {"days": 2, "city": "Paris"})], tokenizer), False),  # not the schema's order
             (render([("get_weather", {"city": "Paris", "days": 30})], tokenizer), False),  # above its maximum
             (render([("get_weather", {"city": "a<b"})], tokenizer), False),  # '<' cannot be in a string
             (render([("configure", {"ratio": 1, "mode": "slow"})], tokenizer), False),  # not in the enum
             (render([("configure", {"ratio": "high"})], tokenizer), False)]  # not a number
    for text, ok in cases:
        m = llguidance.LLMatcher(lltok, grammar)
        assert (m.consume_tokens(tokenizer.encode(text)) and m.is_accepting()) == ok, text
