"""DeepSeek-V4 DSML tool calls on recorded outputs: whole, and split at every character boundary into stream
deltas, they give the same content and calls; string="true" values are raw text, string="false" values JSON;
the blank lines before a block are not content; arguments only grow, one whole parameter at a time; malformed
blocks stay content; the forced-call grammar validates and matches what the deepseek_v4 chat template renders,
and nothing else."""
from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.hf as llguidance_hf
import pytest

from tool_format_checks import assert_arguments_only_grow, assert_whole_and_streamed_agree
from ladle.entrypoints.openai.chat.tool_parsers.base import ToolStream, parse_whole
from ladle.entrypoints.openai.chat.tool_parsers.deepseek_v4 import BLOCK, BLOCK_END, D, DeepSeekV4Format

FMT = DeepSeekV4Format()
TEMPLATE = Path(__file__).parent.parent / "ladle" / "testing" / "chat_templates" / "deepseek_v4.jinja"
TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]},
         "configure": {"type": "object", "properties": {
             "mode": {"type": "string", "enum": ["fast", "safe"]}, "ratio": {"type": "number"},
             "enabled": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
             "required": ["mode"]},
         "noop": {"type": "object", "properties": {}}}


def param(key: str, value: str, string: bool = True) -> str:
    return f'<{D}parameter name="{key}" string="{"true" if string else "false"}">{value}</{D}parameter>\n'


def invoke(name: str, *params: str) -> str:
    return f'<{D}invoke name="{name}">\n{"".join(params)}</{D}invoke>'


def block(*invokes: str) -> str:
    """A block as the model writes it, with the blank lines before it."""
    return f"\n\n{BLOCK}\n" + "\n".join(invokes) + f"\n{BLOCK_END}"


PARIS = invoke("get_weather", param("city", "Paris"), param("days", "2", string=False))
# (output, content, [(name, arguments)])
OUTPUTS = [
    (block(PARIS), "", [("get_weather", {"city": "Paris", "days": 2})]),
    (block(PARIS, invoke("get_weather", param("city", "Tokyo")), invoke("noop")), "",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Tokyo"}), ("noop", {})]),
    ("Let me check." + block(PARIS), "Let me check.", [("get_weather", {"city": "Paris", "days": 2})]),
    (block(PARIS)[2:], "", [("get_weather", {"city": "Paris", "days": 2})]),  # after </think>: no blank lines
    (block(invoke("configure", param("mode", 'a "quoted"\nline {x}'), param("ratio", "0.5", False),
                  param("enabled", "true", False), param("tags", '["a", "b"]', False),
                  param("extra", '{"k": null}', False))), "",
     [("configure", {"mode": 'a "quoted"\nline {x}', "ratio": 0.5, "enabled": True, "tags": ["a", "b"],
                     "extra": {"k": None}})]),
    (block(invoke("configure", param("ratio", "NaN", False), param("tags", "[1, 2", False))), "",
     [("configure", {"ratio": "NaN", "tags": "[1, 2"})]),  # not JSON: the text as a string
    (block(PARIS)[:-len(BLOCK_END)], "", [("get_weather", {"city": "Paris", "days": 2})]),  # the block never closed
    (f"\n\n{BLOCK}\n{invoke('get_weather', param('city', 'Rome'))[:-len(D) - 9]}", "",
     [("get_weather", {"city": "Rome"})]),  # the output ended inside the invoke
    (f"\n\n{BLOCK}\n" + PARIS[:PARIS.find("Paris")], "", [("get_weather", {})]),  # ... and inside a value
    (block(PARIS) + "\n\nDone.", "\n\nDone.", [("get_weather", {"city": "Paris", "days": 2})]),
    (f"Hi\n\n{BLOCK}\nnot a call\n{BLOCK_END} and text", f"Hi\n\n{BLOCK}\nnot a call\n{BLOCK_END} and text", []),
    (f"\n\n{BLOCK}\n{invoke('')}\n{BLOCK_END}", f"\n\n{BLOCK}\n{invoke('')}\n{BLOCK_END}", []),  # no name
    (f"\n\n{BLOCK}\n{BLOCK_END}", f"\n\n{BLOCK}\n{BLOCK_END}", []),  # an empty block
    (f"\n\n{BLOCK}\n<{D}invoke na", f"\n\n{BLOCK}\n<{D}invoke na", []),  # cut off before the name
    (f"Text that mentions <{D}tool_ca", f"Text that mentions <{D}tool_ca", []),  # a tag cut off is text
    ("plain answer,\n\nno calls\n", "plain answer,\n\nno calls\n", []),
]


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_whole_and_streamed_agree(text, content, calls):
    assert_whole_and_streamed_agree(FMT, text, content, calls, TOOLS)


@pytest.mark.parametrize("text", [t for t, _, calls in OUTPUTS if calls])
def test_arguments_only_grow_and_end_as_json(text):
    region = text[text.find(BLOCK):]
    end = FMT.region_end(region)
    region = region if end is None else region[:end]
    assert_arguments_only_grow(FMT, region, TOOLS, len(BLOCK))


def test_arguments_stream_one_whole_parameter_at_a_time():
    stream = ToolStream(FMT, TOOLS)
    pieces = [d for ch in block(PARIS) for d in stream.feed(ch).tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].id
    assert [p.arguments for p in pieces] == ["{", '"city": "Paris"', ', "days": 2', "}"]


def test_content_streams_as_it_comes_and_holds_back_only_blank_lines():
    stream = ToolStream(FMT, TOOLS)
    sent = [stream.feed(ch).content for ch in "Let me check.\n\n<"]
    assert "".join(sent) == "Let me check." and sent[12] == "."  # no character waits but the possible framing


def render(content: str, calls: list[tuple[str, dict]], tokenizer) -> str:
    """The assistant turn the deepseek_v4 template renders (chat mode): the text a model trained on it writes."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": content,
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=TEMPLATE.read_text(), tokenize=False)
    return text.split("<\uff5cAssistant\uff5c></think>")[-1].split("<\uff5cend\u2581of\u2581sentence\uff5c>")[0]


def test_template_rendering_parses_back(tokenizer):
    calls = [("get_weather", {"city": "Paris", "days": 2}),
             ("configure", {"mode": "safe", "ratio": 0.25, "enabled": False, "tags": ["x"]})]
    text = render("Checking both.", calls, tokenizer)
    assert text == "Checking both." + block(PARIS, invoke("configure", param("mode", "safe"),
                                                          param("ratio", "0.25", False),
                                                          param("enabled", "false", False),
                                                          param("tags", '["x"]', False)))
    content, got = parse_whole(FMT, text, TOOLS)
    assert content == "Checking both." and [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert render(content, calls, tokenizer) == text  # the content read back renders the same turn again


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammar_compiles_and_matches_the_format(parallel, tokenizer):
    grammar = llguidance.grammar_from("grammar", FMT.grammar(TOOLS, parallel))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    lltok = llguidance_hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    config = invoke("configure", param("mode", "fast"), param("tags", '[ "a" ]', False))
    cases = [
        (block(PARIS), True),
        (block(invoke("noop")), True),
        (block(invoke("get_weather", param("city", "Oslo"))), True),  # an optional parameter left out
        (block(config), True),
        (block(PARIS, invoke("noop")), parallel),  # a second call
        (block(invoke("other")), False),  # a name no tool has
        (block(invoke("get_weather", param("days", "2", False))), False),  # a required parameter missing
        (block(invoke("get_weather", param("city", "Paris", False))), False),  # a string as JSON
        (block(invoke("get_weather", param("city", "Paris"), param("days", "two", False))), False),
        (block(invoke("get_weather", param("days", "2", False), param("city", "Paris"))), False),  # out of order
        (block(invoke("configure", param("mode", "slow"))), False),  # not in the enum
        (block(invoke("noop", param("x", "1"))), False),  # a parameter the schema has not
        (block(PARIS)[2:], False),  # the grammar writes the blank lines first
    ]
    for text, ok in cases:
        m = llguidance.LLMatcher(lltok, grammar)
        assert (m.consume_tokens(tokenizer.encode(text)) and m.is_accepting()) == ok, text


def test_a_free_form_schema_takes_any_parameters(tokenizer):
    tools = {"run": {"type": "object"}}
    grammar = llguidance.grammar_from("grammar", FMT.grammar(tools, parallel=False))
    lltok = llguidance_hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    text = block(invoke("run", param("cmd", "ls -l"), param("n", "3", False)))
    m = llguidance.LLMatcher(lltok, grammar)
    assert m.consume_tokens(tokenizer.encode(text)) and m.is_accepting()
    assert parse_whole(FMT, text, tools)[1][0].arguments == '{"cmd": "ls -l", "n": 3}'
