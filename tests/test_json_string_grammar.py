"""A Lark grammar rewritten over JSON-string escaping (ladle.structured_output.json_string_grammar): texts drawn
at random from the rewritten grammar are JSON-string contents that json.loads reads back to texts of the
client's grammar (checked by an equivalent Python regex); escaped texts of the grammar's language are accepted
and others refused; Codex's apply_patch grammar compiles and holds; what cannot be rewritten is refused by
name; and a forced call in the hermes and llama3_json formats holds a custom tool's input to its grammar."""
from __future__ import annotations

import json
import random
import re

import llguidance
import numpy as np
import pytest

from ladle.entrypoints.openai.chat.tool_parsers import FORMATS
from ladle.entrypoints.openai.chat.tool_parsers.base import UnsupportedSchema, parse_whole
from ladle.structured_output.json_string_grammar import UnsupportedGrammar, json_string_grammar
from ladle.structured_output.matcher import lltokenizer, tokenizer_spec

# Codex's apply_patch tool grammar (codex-rs tool_apply_patch.lark), which the Responses API sends as a custom
# tool's format
APPLY_PATCH = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''
# (grammar, a Python regex of the same language): quotes, backslashes, control characters, classes, ranges,
# case-insensitive literals and common imports
CASES = [
    (r'''start: line{1,3}
line: ("+" | "-") /[a-z"\\ ]{1,8}/ "\n"
''', r'(?:[+-][a-z"\\ ]{1,8}\n){1,3}'),
    (r'''start: "say " /[^\n]{0,6}/ TAIL
TAIL: "\t\"end\"" | "\x01"
''', r'say [^\n]{0,6}(?:\t"end"|\x01)'),
    (r'''start: WORD ("," INT)* NEWLINE
%import common (WORD, INT, NEWLINE)
''', r'[a-zA-Z]+(?:,[0-9]+)*(?:\r?\n)+'),
    (r'''start: "ab\n"i /\s{1,2}/ ("x".."z")+
''', r'[aA][bB]\n[\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]{1,2}[x-z]+'),
]


@pytest.fixture(scope="module")
def lltok(tokenizer):
    return lltokenizer(tokenizer_spec(tokenizer, len(tokenizer), [tokenizer.eos_token_id]))


def matcher(grammar: str, lltok) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(lltok, llguidance.grammar_from("grammar", grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(grammar: str, text: str, lltok, tokenizer) -> bool:
    m = matcher(grammar, lltok)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def draw(grammar: str, lltok, tokenizer, rng: random.Random, limit: int = 400) -> str:
    """A text the grammar allows, each token drawn at random from those its mask allows, until it completes."""
    m = matcher(grammar, lltok)
    ids: list[int] = []
    while not m.is_stopped() and not (m.is_accepting() and rng.random() < 0.3):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:len(tokenizer)]
        allowed = [t for t in np.flatnonzero(bits).tolist() if t != tokenizer.eos_token_id]
        if not allowed:
            break
        token = rng.choice(allowed)
        assert m.consume_token(token), m.get_error()
        ids.append(token)
        assert len(ids) < limit, tokenizer.decode(ids)
    return tokenizer.decode(ids)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_drawn_texts_read_back_to_the_grammars_language(case, lltok, tokenizer):
    grammar, regex = CASES[case]
    escaped = json_string_grammar(grammar)
    rng = random.Random(case)
    for _ in range(12):
        text = draw(escaped, lltok, tokenizer, rng)
        raw = json.loads(f'"{text}"')  # a JSON string's contents, as a call's JSON holds them
        assert re.fullmatch(regex, raw), (text, raw)


def test_escaped_texts_of_the_language_are_accepted_and_others_refused(lltok, tokenizer):
    escaped = json_string_grammar(CASES[0][0])
    for raw in ['+a "b"\n', '-\\\\x\n+ \n', '+q\n-r\n+s\n']:
        assert accepts(escaped, json.dumps(raw)[1:-1], lltok, tokenizer), raw
    for raw in ['+ab', '*a\n', '+a\n+b\n+c\n+d\n', '+ABC\n']:
        assert not accepts(escaped, json.dumps(raw)[1:-1], lltok, tokenizer), raw
    assert not accepts(escaped, '+a "b"\n', lltok, tokenizer)  # raw quote and newline: not a JSON string's


def test_apply_patch_holds_in_a_json_string(lltok, tokenizer):
    escaped = json_string_grammar(APPLY_PATCH)
    good = ['*** Begin Patch\n*** Delete File: a\n*** End Patch\n',
            '*** Begin Patch\n*** Add File: a "b".py\n+print("hi\\t")\n+\tx = 1\n*** End Patch\n',
            '*** Begin Patch\n*** Update File: x/y.c\n@@ int main\n-\treturn 1;\n+\treturn 0;\n \n'
            '*** End of File\n*** End Patch']
    for raw in good:
        assert accepts(APPLY_PATCH, raw, lltok, tokenizer)
        assert accepts(escaped, json.dumps(raw)[1:-1], lltok, tokenizer), raw
    for raw in ['*** Begin Patch\n*** Add File: a.py\nprint(1)\n*** End Patch\n', '*** Begin Patch\n*** End Patch\n']:
        assert not accepts(escaped, json.dumps(raw)[1:-1], lltok, tokenizer), raw


@pytest.mark.parametrize("grammar,named", [
    ('start: %json {"type": "string"}', "%json"),
    ("start: <|im_end|>", "special tokens"),
    ('start: "a" WS\n%ignore WS\n%import common.WS', "%ignore"),
    ('start: A\nA: /[a-z]+/ & /ab+/', "the & operator"),
    ("start: /a(?=b)b/", "assert"),
    ("start: /^ab$/", "anchors"),
    ("start: X\n%import common.ESCAPED_STRING -> X", "common terminals"),
    ("start: /[[:alpha:]]/", "cannot be rewritten"),
    ('start: @other', "grammar references"),
    ("start: /" + "." * 16_000 + "/", "passes 1048576 characters"),  # each class is some 330 characters
    ("start: " + '"a" ' * 5_000, "at most 16384"),
])
def test_what_cannot_be_rewritten_is_refused_by_name(grammar, named):
    with pytest.raises(UnsupportedGrammar, match=re.escape(named)):
        json_string_grammar(grammar)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_forced_calls_hold_a_custom_tools_input_to_its_grammar(fmt, lltok, tokenizer):
    grammar, regex = CASES[0]
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                             "required": ["city"], "additionalProperties": False},
             "patch": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}
    call_grammar = FORMATS[fmt].grammar(tools, False, {"patch": grammar})
    rng = random.Random(3)
    seen = set()
    for _ in range(10):
        text = draw(call_grammar, lltok, tokenizer, rng, limit=800)
        content, calls = parse_whole(FORMATS[fmt], text, tools)
        assert calls and not content.strip(), text
        for call in calls:
            seen.add(call.name)
            args = json.loads(call.arguments)
            if call.name == "patch":
                assert re.fullmatch(regex, args["input"]), args
            else:
                assert len(args["city"]) <= 5
    assert seen == set(tools)


def test_tag_formats_refuse_a_grammar_by_the_tools_name():
    for fmt in ("qwen3_coder", "deepseek_v4"):
        with pytest.raises(UnsupportedSchema, match="tool 'patch': its input is held to a Lark grammar"):
            FORMATS[fmt].grammar({"patch": {"type": "object", "properties": {"input": {"type": "string"}}}}, False,
                                 {"patch": CASES[0][0]})
