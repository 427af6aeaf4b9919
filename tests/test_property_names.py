"""propertyNames rewritten for llguidance: a rewritten schema allows exactly the objects the original does (both
judged by the jsonschema package over names and values that tell the cases apart) and compiles; a propertyNames
no rewrite can say exactly stays, and llguidance's refusal names it."""
from __future__ import annotations

import itertools

import jsonschema
import llguidance
import pytest

from ladle.structured_output.property_names import rewrite_property_names

INT, STR = {"type": "integer"}, {"type": "string"}
EXACT = [
    ("zod's z.record (Claude Code's metadata)", {"type": "object", "propertyNames": STR, "additionalProperties": {}}),
    ("true", {"type": "object", "propertyNames": True, "additionalProperties": INT}),
    ("annotations only", {"propertyNames": {"description": "any key", "minimum": 3}, "properties": {"a": INT}}),
    ("false", {"type": "object", "propertyNames": False}),
    ("no string type", {"type": "object", "propertyNames": INT, "properties": {"a": INT},
                        "patternProperties": {"b": INT}}),
    ("enum", {"type": "object", "propertyNames": {"enum": ["a", "b", 7]}, "properties": {"a": STR, "c": INT},
              "additionalProperties": INT, "required": ["a"]}),
    ("const and length", {"type": "object", "propertyNames": {"const": "ab", "minLength": 3}}),
    ("enum and length", {"type": "object", "propertyNames": {"type": "string", "enum": ["a", "ab", "abc"],
                                                             "maxLength": 2}, "additionalProperties": INT}),
    ("pattern", {"type": "object", "propertyNames": {"pattern": "^x"}, "additionalProperties": {"type": "boolean"}}),
    ("pattern, values free", {"type": "object", "propertyNames": {"type": "string", "pattern": "b"}}),
    ("length", {"type": "object", "propertyNames": {"minLength": 2, "maxLength": 2}, "additionalProperties": INT}),
    ("nested", {"type": "object", "properties": {"propertyNames": STR, "inner": {"$ref": "#/$defs/Rec"}},
                "$defs": {"Rec": {"type": "object", "propertyNames": STR, "additionalProperties": INT}},
                "additionalProperties": {"type": "array", "items": {"propertyNames": {"enum": ["a"]}}}}),
]
# Where no rewrite is exact: a pattern beside properties or patternProperties (a name both match would be held to
# both schemas), an enum beside patternProperties, a keyword raw regexes cannot say.
KEPT = [
    {"propertyNames": {"pattern": "^a"}, "properties": {"b": INT}},
    {"propertyNames": {"pattern": "^a"}, "patternProperties": {"b": INT}},
    {"propertyNames": {"enum": ["a"]}, "patternProperties": {"b": INT}},
    {"propertyNames": {"format": "email"}},
    {"propertyNames": {"pattern": "^a", "maxLength": 3}},
]
NAMES = ["a", "b", "c", "ab", "abc", "x1", "xy", "7", ""]
VALUES = [1, "s", True, None, [{"a": 1}], [{"b": 1}], {"a": 1}, {"k": "v"}]


def instances() -> list[dict]:
    singles = [{n: v} for n in NAMES for v in VALUES]
    pairs = [{a: 1, b: "s"} for a, b in itertools.combinations(NAMES, 2)]
    return [{}, *singles, *pairs, {"a": "s", "b": 2}, {"a": "s", "c": 3}]


@pytest.mark.parametrize("schema", [s for _, s in EXACT], ids=[n for n, _ in EXACT])
def test_a_rewrite_allows_exactly_what_the_original_does(schema):
    rewritten = rewrite_property_names(schema)
    assert "propertyNames" not in str(rewritten.get("additionalProperties")) and "propertyNames" not in rewritten
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(rewritten)) == ""
    before, after = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(rewritten)
    for value in instances():
        assert before.is_valid(value) == after.is_valid(value), (value, rewritten)


@pytest.mark.parametrize("schema", KEPT)
def test_what_no_rewrite_says_exactly_is_refused_by_name(schema):
    assert rewrite_property_names(schema) == schema
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    assert "propertyNames" in llguidance.LLMatcher.validate_grammar(grammar)


def test_the_request_schema_is_left_as_it_was():
    schema = {"type": "object", "properties": {"m": {"propertyNames": STR}}, "enum": [{"propertyNames": 1}]}
    copy = {"type": "object", "properties": {"m": {"propertyNames": STR}}, "enum": [{"propertyNames": 1}]}
    assert rewrite_property_names(schema) == {"type": "object", "properties": {"m": {}},
                                              "enum": [{"propertyNames": 1}]}  # data is no schema
    assert schema == copy
