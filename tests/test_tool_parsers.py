"""Tool-call and reasoning parsers on recorded model outputs: whole, and split at every character boundary into
stream deltas, they give the same content, thinking and calls; names come before arguments, arguments only grow;
malformed calls stay content; the forced-call grammars validate."""
from __future__ import annotations

import json

import llguidance
import llguidance.hf as llguidance_hf
import pytest

from tool_format_checks import assert_whole_and_streamed_agree
from ladle.entrypoints.openai.chat.reasoning_parser import PARSERS
from ladle.entrypoints.openai.chat.tool_parsers import FORMATS
from ladle.entrypoints.openai.chat.tool_parsers.base import ToolStream

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]},
         "noop": {"type": "object", "properties": {}}}

# (output, content, [(name, arguments)]) in the hermes format (Qwen3)
HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>', "",
     [("get_weather", {"city": "Paris", "days": 2})]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>', "Let me check.\n",
     [("get_weather", {"city": "Paris"}), ("noop", {})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a \\"}\\" b {x}"}}\n</tool_call>', "",
     [("get_weather", {"city": 'a "}" b {x}'})]),  # braces and quotes inside a string
    ('<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>', "",
     [("get_weather", {"city": "Oslo"})]),  # keys in the other order
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', "",
     [("get_weather", {"city": "Rome"})]),  # the closing tag never came
    ('<tool_call>\nnot json at all\n</tool_call> and text', "<tool_call>\nnot json at all\n</tool_call> and text", []),
    ('Text that mentions <tool_call', "Text that mentions <tool_call", []),  # a tag cut off is text
    ('plain answer, no calls', "plain answer, no calls", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES)
def test_hermes_whole_and_streamed_agree(text, content, calls):
    assert_whole_and_streamed_agree(FORMATS["hermes"], text, content, calls, TOOLS)


def test_hermes_streams_arguments_in_pieces_as_they_come():
    fmt, text = FORMATS["hermes"], HERMES[0][0]
    stream = ToolStream(fmt, TOOLS)
    pieces = [d for ch in text for d in stream.feed(ch).tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].arguments == ""
    assert len([p for p in pieces if p.arguments]) > 5  # not one piece at the end


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammars_compile_and_match_the_format(parallel, tokenizer):
    fmt = FORMATS["hermes"]
    grammar = llguidance.grammar_from("grammar", fmt.grammar(TOOLS, parallel))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    lltok = llguidance_hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    call = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    for text, ok in ((call, True), (call + "\n" + call, parallel), ('<tool_call>\n{"name": "other", "arguments": {}}',
                                                                   False)):
        m = llguidance.LLMatcher(lltok, grammar)
        assert (m.consume_tokens(tokenizer.encode(text)) and m.is_accepting()) == ok, text


# (prompt opened the block, output, reasoning, answer)
REASONING = [
    (False, "<think>\nLet me think.\n</think>\n\nThe answer.", "Let me think.\n", "The answer."),
    (True, "Still thinking</think>\n\nDone", "Still thinking", "Done"),
    (True, "cut off while thinking", "cut off while thinking", ""),
    (False, "No thinking at all.", "", "No thinking at all."),
    (False, "  <thin", "", "  <thin"),  # a cut-off tag at the end is answer text
    (False, "<thinker> is not a tag", "", "<thinker> is not a tag"),
    (True, "a</thi", "a</thi", ""),
    (True, "plan\n<tool_call>\n<function=f>\n</function>\n</tool_call>", "plan\n",
     "<tool_call>\n<function=f>\n</function>\n</tool_call>"),  # Qwen3.5 calls from inside its thinking
    (True, "a <tool_call> mentioned", "a <tool_call> mentioned", ""),
]


@pytest.mark.parametrize("opened, text, reasoning, answer", REASONING)
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_reasoning_whole_and_streamed_agree(name, opened, text, reasoning, answer):
    if name != "qwen3" and "<function=" in text:
        reasoning, answer = text, ""  # only Qwen's parser reads an XML call as the end of thinking
    for pieces in ([text], list(text)):
        s = PARSERS[name].stream(opened)
        got = [s.feed(p) for p in pieces] + [s.finish()]
        assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == (reasoning, answer)


def test_the_prompt_says_whether_thinking_is_open():
    p = PARSERS["qwen3"]
    assert p.starts_thinking("<|im_start|>assistant\n<think>\n")
    assert not p.starts_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not p.starts_thinking("<|im_start|>assistant\n")


def test_a_long_call_is_not_read_again_on_every_delta():
    """A file an agent writes can be tens of kilobytes of arguments: each read scans the region, so reading it
    on every delta would cost their square. Reads come once the region grew by a sixteenth (the same calls)."""
    from ladle.entrypoints.openai.chat.tool_parsers.hermes import HermesFormat

    class Counting(HermesFormat):
        reads = 0

        def progress(self, region, tools, final):
            Counting.reads += 1
            return super().progress(region, tools, final)

    content = "x = 1\n" * 3000
    text = '<tool_call>\n' + json.dumps({"name": "noop", "arguments": {"content": content}}) + '\n</tool_call>'
    stream = ToolStream(Counting(), TOOLS)
    args = ""
    for i in range(0, len(text), 4):
        args += "".join(t.arguments for t in stream.feed(text[i:i + 4]).tool_calls)
    args += "".join(t.arguments for t in stream.finish().tool_calls)
    assert json.loads(args) == {"content": content}
    assert Counting.reads < 200 < len(text) // 4  # 5,000 deltas
