"""Every tool the recorded agent CLIs send (Claude Code's 24, Codex's functions, OpenCode's) can be forced in every
tool-call format: its schema compiles, and calls drawn at random from the grammar parse back into arguments valid
against the schema as the client sent it (checked by the jsonschema package, formats included); what a format
cannot write exactly is refused naming the tool, the parameter and the keyword. Claude Code's TaskCreate and
TaskUpdate say their metadata's keys with propertyNames, which llguidance does not implement: forcing either was a
400 "Unimplemented keys" until ladle.structured_output.property_names."""
from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import llguidance
import numpy as np
import pytest
from transformers import AutoTokenizer

from agent_clients.recorded import recorded_requests, tool_schemas
from ladle.entrypoints.openai.chat.tool_parsers import FORMATS
from ladle.entrypoints.openai.chat.tool_parsers.base import UnsupportedSchema, parse_whole
from ladle.structured_output.matcher import lltokenizer, tokenizer_spec
from ladle.testing.tool_checkpoints import build_tool_checkpoint

REQUESTS = recorded_requests()
# (client, format, tool) -> the words its refusal must hold: what raw text cannot be held to.
REFUSED = {("claude-code-2.1.197", "qwen3_coder", "WebFetch"): ["parameter 'url'", '"format": "uri"']}


class Drawer:
    """Texts a grammar allows, drawn token by token from its mask with the server's view of the tokenizer (the
    format's tags as single tokens). Uniform draws would write strings for thousands of tokens, so half the time a
    token that may close something is preferred: a tag's "<" or a newline before it, else a quote or bracket."""

    def __init__(self, model_dir: str) -> None:
        self.hf = AutoTokenizer.from_pretrained(model_dir)
        self.lltok = lltokenizer(tokenizer_spec(self.hf, len(self.hf), [self.hf.eos_token_id]))
        texts = [self.hf.decode([t]) for t in range(len(self.hf))]
        self.closers = [np.array([any(c in s for c in chars) for s in texts]) for chars in ("<\n", '"}]')]

    def draw(self, grammar: str, rng: random.Random, limit: int = 20000) -> str:
        m = llguidance.LLMatcher(self.lltok, llguidance.grammar_from("grammar", grammar))
        assert not m.is_error(), m.get_error()
        ids: list[int] = []
        while not m.is_stopped() and not (m.is_accepting() and rng.random() < 0.7):
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:len(self.hf)]
            bits[self.hf.eos_token_id] = 0
            allowed = np.flatnonzero(bits)
            assert len(allowed), self.hf.decode(ids)
            pool = allowed
            for closer in self.closers:
                near = allowed[closer[allowed]]
                if len(near) and rng.random() < 0.5:
                    pool = near
                    break
            token = int(pool[rng.randrange(len(pool))])
            assert m.consume_token(token), m.get_error()
            ids.append(token)
            assert len(ids) < limit, self.hf.decode(ids)
        return self.hf.decode(ids)


@pytest.fixture(scope="module")
def drawer(tmp_path_factory: pytest.TempPathFactory) -> Drawer:
    return Drawer(build_tool_checkpoint(tmp_path_factory.mktemp("tags"), "qwen3"))


def check_draws(fmt: str, tools: dict[str, Any], parallel: bool, drawer: Drawer, rng: random.Random,
                draws: int) -> None:
    grammar = FORMATS[fmt].grammar(tools, parallel)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", grammar)) == ""
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    validators = {name: jsonschema.Draft202012Validator(s, format_checker=checker) for name, s in tools.items()}
    for _ in range(draws):
        text = drawer.draw(grammar, rng)
        content, calls = parse_whole(FORMATS[fmt], text, tools)
        assert calls and not content.strip(), text
        assert parallel or len(calls) == 1
        for call in calls:
            errors = [e.message for e in validators[call.name].iter_errors(json.loads(call.arguments))]
            assert not errors, (call.name, call.arguments, errors)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("client", sorted(REQUESTS))
def test_every_tool_forced_by_name_holds_to_its_schema(client: str, fmt: str, drawer: Drawer) -> None:
    tools = tool_schemas(REQUESTS[client]["body"])
    assert tools
    rng = random.Random(f"{client} {fmt}")
    refused = set()
    for name, schema in tools.items():
        try:
            check_draws(fmt, {name: schema}, False, drawer, rng, draws=4)
        except UnsupportedSchema as e:
            words = REFUSED.get((client, fmt, name), [])
            assert all(w in str(e) for w in [f"tool {name!r}", fmt, *words]), str(e)
            refused.add((client, fmt, name))
    assert refused == {r for r in REFUSED if r[:2] == (client, fmt)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("client", sorted(REQUESTS))
def test_required_over_all_tools_holds_to_each_schema(client: str, fmt: str, drawer: Drawer) -> None:
    """tool_choice "required" with the client's whole tool list (less what the format refuses), parallel calls."""
    tools = {name: s for name, s in tool_schemas(REQUESTS[client]["body"]).items()
             if (client, fmt, name) not in REFUSED}
    check_draws(fmt, tools, True, drawer, random.Random(f"{client} {fmt} all"), draws=12)
