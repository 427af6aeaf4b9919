"""Forced calls in the JSON formats (hermes, llama3_json) when a custom tool's input is held to a Lark grammar.

Such an input is a JSON string inside the call, so its grammar is the client's rewritten for a JSON string
(ladle.structured_output.json_string_grammar), nested as its own %lark block. The calls are then written as
the format's literal text, one alternative per tool, the name first: a function's arguments by %json of its
parameters, a custom tool's {"input": "..."} by its grammar. (One %json over every call, as without custom tools,
cannot hold the grammar, and llguidance's lexer could not choose between a %json call and a literal one at
their shared opening brace.)
"""
from __future__ import annotations

import json
from collections.abc import Mapping

from ladle.entrypoints.openai.chat.tool_parsers.base import Tools, UnsupportedSchema
from ladle.structured_output.grammar import DEFAULT_WHITESPACE
from ladle.structured_output.json_string_grammar import UnsupportedGrammar, json_string_grammar

INPUT = "input"  # a custom tool's one parameter, as the model is shown it (responses_tools)


def json_calls(tools: Tools, grammars: Mapping[str, str], key: str) -> tuple[str, list[str]]:
    """The call's expression (an alternative per tool) and the rules it uses; key: the format's name for the
    arguments ("arguments", "parameters")."""
    alternatives, rules = [], []
    for i, (name, params) in enumerate(tools.items()):
        head = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": '
        if name in grammars:
            try:
                inner = json_string_grammar(grammars[name])
            except UnsupportedGrammar as e:
                raise UnsupportedSchema(f"tool {name!r}: its Lark grammar cannot be held inside the call's JSON "
                                        f"string: {e}") from None
            rules.append(f"call_{i}: {_lit(head + '{' + json.dumps(INPUT) + ': ' + chr(34))} input_{i} "
                         f"{_lit(chr(34) + '}}')}")
            rules.append(f"input_{i}: %lark {{\n{inner}\n}}")
        else:
            schema = {**(params or {"type": "object"}), "x-guidance": {"whitespace_pattern": DEFAULT_WHITESPACE}}
            rules.append(f"call_{i}: {_lit(head)} %json {json.dumps(schema, ensure_ascii=False)} {_lit('}')}")
        alternatives.append(f"call_{i}")
    return " | ".join(alternatives), rules


def _lit(text: str) -> str:
    """Text as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)
