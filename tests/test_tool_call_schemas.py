"""Forced tool calls hold to every schema response_format holds to: each schema of the structured-output corpus,
as a tool's parameters, compiles into every format's call grammar; calls drawn at random from the grammar parse
back into arguments valid against the schema (checked by the jsonschema package, formats included). $defs and
$ref (pydantic's and zod's nested models) resolve wherever the parameters sit; what a tag format cannot hold is
a refusal naming the tool and parameter, never a call that breaks the schema."""
from __future__ import annotations

import copy
import json
import random

import jsonschema
import llguidance
import llguidance.hf as llguidance_hf
import numpy as np
import pytest

from structured_corpus import SCHEMAS
from ladle.entrypoints.openai.chat.tool_parsers import FORMATS
from ladle.entrypoints.openai.chat.tool_parsers.base import UnsupportedSchema, parse_whole
from ladle.structured_output.schema_refs import deref, relocate, standalone

REPRO = {"$defs": {"A": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/A"}},
         "required": ["x"]}  # the issue's: forced calls answered 400 "Pointer '/$defs/A' does not exist"
# pydantic's Optional[Model] and list[Model], a recursive model, and a ref with a description beside it
NESTED = {
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["x", "y"], "additionalProperties": False},
              "Color": {"enum": ["red", "green"], "type": "string"},
              "Tree": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                        "kids": {"type": "array", "items": {"$ref": "#/$defs/Tree"},
                                                                 "maxItems": 1}},
                       "required": ["v"], "additionalProperties": False}},
    "type": "object",
    "properties": {"at": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]},
                   "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}, "maxItems": 2},
                   "color": {"$ref": "#/$defs/Color", "description": "which one"},
                   "tree": {"$ref": "#/$defs/Tree"}},
    "required": ["at", "color", "tree"], "additionalProperties": False}
# zod-to-json-schema's way: the whole parameters object a ref into definitions
ZOD = {"$ref": "#/definitions/Args", "definitions": {"Args": {
    "type": "object", "properties": {"n": {"$ref": "#/definitions/N"}, "s": {"type": "string", "maxLength": 3}},
    "required": ["n", "s"], "additionalProperties": False}, "N": {"type": "integer", "minimum": 1, "maximum": 3}}}
# (format, corpus index): what a format cannot write (raw text has no "format": "uuid")
REFUSED = {("qwen3_coder", next(i for i, s in enumerate(SCHEMAS) if "uuid" in json.dumps(s)))}


def parameters_of(schema: dict) -> dict:
    """A corpus schema as a tool's parameters: an object as it is, anything else the one required property."""
    if schema.get("type") == "object":
        return schema
    return {"type": "object", "properties": {"value": schema}, "required": ["value"], "additionalProperties": False}


@pytest.fixture(scope="module")
def lltok(tokenizer):
    return llguidance_hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))


def draw(grammar: str, lltok, tokenizer, rng: random.Random, limit: int = 3000) -> str:
    """A text the grammar allows, each token drawn at random from those its mask allows, until it completes.
    Whitespace is drawn rarely and a complete text mostly ends there: uniform draws would pad and go on."""
    m = llguidance.LLMatcher(lltok, llguidance.grammar_from("grammar", grammar))
    assert not m.is_error(), m.get_error()
    ids: list[int] = []
    while not m.is_stopped() and not (m.is_accepting() and rng.random() < 0.7):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:len(tokenizer)]
        allowed = [t for t in np.flatnonzero(bits).tolist() if t != tokenizer.eos_token_id]
        if not allowed:
            break
        solid = [t for t in allowed if tokenizer.decode([t]).strip()]
        token = rng.choice(solid if solid and rng.random() < 0.9 else allowed)
        assert m.consume_token(token), m.get_error()
        ids.append(token)
        assert len(ids) < limit, tokenizer.decode(ids)
    return tokenizer.decode(ids)


def check_forced_calls(fmt_name: str, params: dict, lltok, tokenizer, seed: int, draws: int = 3) -> None:
    """Two tools with these parameters (so they sit at a second place in the call schema too), parallel calls:
    every drawn call parses back to arguments valid against the parameters."""
    fmt, tools = FORMATS[fmt_name], {"first": params, "second": copy.deepcopy(params)}
    grammar = fmt.grammar(tools, parallel=True)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", grammar)) == ""
    validator = jsonschema.Draft202012Validator(params, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    rng = random.Random(seed)
    for _ in range(draws):
        text = draw(grammar, lltok, tokenizer, rng)
        content, calls = parse_whole(fmt, text, tools)
        assert calls and not content.strip(), text
        for call in calls:
            errors = [e.message for e in validator.iter_errors(json.loads(call.arguments))]
            assert not errors, (text, call.arguments, errors)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_corpus_schema_holds_in_forced_calls(fmt, lltok, tokenizer):
    refused = set()
    for i, schema in enumerate(SCHEMAS):
        try:
            check_forced_calls(fmt, parameters_of(schema), lltok, tokenizer, seed=i)
        except UnsupportedSchema as e:
            assert "tool 'first'" in str(e) and fmt in str(e), e
            refused.add((fmt, i))
    assert refused == {r for r in REFUSED if r[0] == fmt}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("params", [REPRO, NESTED, ZOD], ids=["repro", "nested", "zod"])
def test_defs_and_refs_resolve_in_forced_calls(fmt, params, lltok, tokenizer):
    check_forced_calls(fmt, params, lltok, tokenizer, seed=7, draws=6)


def test_relocate_moves_local_refs_and_nothing_else():
    own = {"$id": "urn:own", "$defs": {"B": {}}, "$ref": "#/$defs/B"}  # a resource of its own: its refs stay
    data = {"const": {"$ref": "#/x"}, "default": {"$ref": "#/x"}}  # JSON values, not schemas
    schema = {"$id": "urn:tool", "$defs": {"A": {"type": "integer"}}, "type": "object", "properties": {
        "a": {"$ref": "#/$defs/A"}, "whole": {"$ref": "#"}, "anchor": {"$ref": "#name"},
        "remote": {"$ref": "https://example.com/s.json"}, "$ref": {"$ref": "#/$defs/A"},
        "enum": {"items": {"$ref": "#/$defs/A"}}, "data": data, "own": own}}
    p = relocate(schema, "/anyOf/1/properties/arguments")["properties"]
    assert p["a"]["$ref"] == p["$ref"]["$ref"] == p["enum"]["items"]["$ref"] == \
        "#/anyOf/1/properties/arguments/$defs/A"  # properties named like keywords are still schemas
    assert p["whole"]["$ref"] == "#/anyOf/1/properties/arguments"
    assert p["anchor"]["$ref"] == "#name" and p["remote"]["$ref"] == "https://example.com/s.json"
    assert p["data"] == data and p["own"] == own
    assert "$id" not in relocate(schema, "/x")  # its refs now resolve through the larger document
    assert schema["properties"]["a"]["$ref"] == "#/$defs/A"  # the request's schema is left as it was


def test_standalone_carries_the_document_its_refs_point_into():
    path = NESTED["properties"]["path"]
    doc = standalone(path, NESTED)
    assert doc["items"]["$ref"] == "#/$defs/ladle_root/$defs/Point"
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(doc)) == ""
    validator = jsonschema.Draft202012Validator(doc)
    assert validator.is_valid([{"x": 1, "y": 2}]) and not validator.is_valid([{"x": 1}])
    tree = standalone({"$ref": "#/$defs/Tree"}, NESTED)  # recursive: the carried copy points into itself
    assert jsonschema.Draft202012Validator(tree).is_valid({"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]})
    plain = {"type": "integer"}
    assert standalone(plain, NESTED) is plain


def test_deref_follows_refs_and_stops_where_a_loop_closes():
    root = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}, "C": {"type": "integer"},
                      "Opt": {"anyOf": [{"$ref": "#/$defs/Opt"}, {"$ref": "#/$defs/C"}]}}}
    assert deref({"$ref": "#/$defs/C", "description": "d"}, root) == {"type": "integer", "description": "d"}
    assert deref({"allOf": [{"$ref": "#/$defs/C"}], "title": "t"}, root) == {"type": "integer", "title": "t"}
    assert deref({"$ref": "#/$defs/C", "type": "string"}, root) == {"allOf": [{"type": "integer"},
                                                                            {"type": "string"}]}
    assert deref({"$ref": "#/$defs/A"}, root) == {"$ref": "#/$defs/A"}  # A -> B -> A: left as a ref
    assert deref({"$ref": "#/$defs/Opt"}, root)["anyOf"][1] == {"type": "integer"}
    assert deref({"$ref": "#/$defs/missing"}, root) == {"$ref": "#/$defs/missing"}


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}
REFUSALS = [
    ("qwen3_coder", {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}},
     ["parameter 'id'", '"format": "uuid"']),
    ("qwen3_coder", {"$defs": {"L": {"$ref": "#/$defs/L"}}, "type": "object", "properties": {"x": {
        "$ref": "#/$defs/L"}}}, ["parameter 'x'", '"#/$defs/L" resolves to no schema']),
    ("qwen3_coder", {"anyOf": [OBJ, OBJ]}, ['"anyOf" over the whole parameters']),
    ("deepseek_v4", {"anyOf": [OBJ, OBJ]}, ['"anyOf" over the whole parameters']),
    ("qwen3_coder", {**OBJ, "required": ["b"]}, ["parameter 'b'", "without a schema"]),
    ("deepseek_v4", {"type": "object", "additionalProperties": {"type": "integer"}}, ["additionalProperties"]),
]


@pytest.mark.parametrize("fmt, params, words", REFUSALS)
def test_what_a_tag_format_cannot_write_is_refused_by_name(fmt, params, words):
    with pytest.raises(UnsupportedSchema) as e:
        FORMATS[fmt].grammar({"lookup": params}, parallel=False)
    assert all(w in str(e.value) for w in ["tool 'lookup'", fmt, *words]), str(e.value)


GARBAGE = [{"properties": [1]}, {"$ref": 5}, {"$ref": "#/nowhere"}, {"required": "a", "properties": {"a": {}}},
           {"properties": {"a": {"type": "string", "minLength": "x", "enum": ["y"]}}},
           {"properties": {"a": {"anyOf": {"x": 1}}}}, {"properties": {"a": {"type": ["string", 5]}}},
           {"properties": {"a": {"type": {"x": 1}}}}, {"properties": {"a": {"enum": "x"}}},
           {"properties": {"a": {"$ref": "#/properties/a"}}}, {"properties": {"a": {"allOf": [{"$ref": "#"}]}}},
           {"type": 7}, {"properties": {"a": False}}]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_malformed_schema_is_refused_or_left_to_the_compiler(fmt):
    """Never an exception the server would answer with a 500: a refusal, or a grammar llguidance judges."""
    for params in GARBAGE:
        try:
            grammar = FORMATS[fmt].grammar({"f": params}, parallel=False)
        except UnsupportedSchema:
            continue
        llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", grammar))
