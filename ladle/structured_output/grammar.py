"""A request's structured-output constraint as an llguidance grammar.

llguidance (Rust, no dependencies) compiles JSON schemas, regexes, Lark and GBNF grammars into matchers that
fill a token bitmask per step. Its JSON compiler refuses schema keywords it does not implement instead of
dropping them, so a schema ladle accepts is a schema it enforces whole.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ladle.sampling_params import StructuredOutputsParams
from ladle.structured_output.property_names import rewrite_property_names

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the stub's TypedDict; llguidance exports no runtime name

# Between two JSON tokens: at most this much whitespace (newlines and indentation included), so a model can
# never emit whitespace forever and a pretty-printing one still writes the layout it learned.
DEFAULT_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"


class InvalidStructuredOutput(ValueError):
    """A constraint that cannot be compiled: `field` names it (structured_outputs.json, ...), the message is the
    compiler's."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) that spec describes; raises InvalidStructuredOutput when the
    spec itself is malformed (a schema that is not JSON). It is not compiled here: see
    ladle.structured_output.checker."""
    import llguidance

    kind = spec.kind
    field = f"structured_outputs.{kind}"
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidStructuredOutput(field, f"is not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidStructuredOutput(field, f"a JSON schema is an object or a bool, got {type(schema).__name__}")
        schema = rewrite_property_names(schema)
        if spec.disable_additional_properties:
            schema = closed_objects(schema)
        options: JsonCompileOptions = ({"whitespace_flexible": False} if spec.disable_any_whitespace else
                                   {"whitespace_flexible": True,
                                    "whitespace_pattern": spec.whitespace_pattern or DEFAULT_WHITESPACE})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise InvalidStructuredOutput(field, str(e)) from None
    try:
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar or "")
    except (ValueError, RuntimeError) as e:  # a GBNF text its converter cannot read, say
        raise InvalidStructuredOutput(field, str(e)) from None


_VALUES = ("const", "enum", "default", "examples")  # keywords whose values are JSON values, not schemas


def closed_objects(schema: Any) -> Any:
    """The schema with additionalProperties: false on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _VALUES else closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
