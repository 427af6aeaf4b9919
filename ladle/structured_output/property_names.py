"""propertyNames, which llguidance does not implement, rewritten into keywords it does where the rewrite allows
exactly the same objects; elsewhere it stays, and llguidance's refusal names it ("Unimplemented keys").

zod 4 writes every z.record as propertyNames beside additionalProperties (Claude Code's TaskCreate and
TaskUpdate tools: `{"propertyNames": {"type": "string"}, "additionalProperties": {}}`), so forcing such a tool
failed to compile although its names constrain nothing: a JSON object's keys are always strings. The exact
rewrites, for an object schema with properties P, patternProperties PP and additionalProperties S:
- names that every string satisfies: the keyword goes;
- names no string satisfies (false, a type without "string"): no key at all (P's names and PP false, nothing
  else);
- names from an enum or const: each allowed name a property (P's schema where P has it, else S), P's other names
  false, and nothing else (additionalProperties false); only without PP, since a name PP matches is not S's;
- names to a pattern, or to length bounds, with neither P nor PP: patternProperties {regex: S} and nothing else
  (both keywords search the name, as JSON Schema and llguidance read a pattern).
"""
from __future__ import annotations

from typing import Any

from ladle.structured_output.schema_refs import DATA_KEYWORDS, NON_CONSTRAINING, SCHEMA_MAPS

# Keywords that constrain only values of other types than string: a name is never held to them.
_NOT_FOR_STRINGS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "items",
                              "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains",
                              "maxContains", "properties", "patternProperties", "additionalProperties", "required",
                              "minProperties", "maxProperties", "dependentRequired", "dependentSchemas"})
_INERT = NON_CONSTRAINING | _NOT_FOR_STRINGS


def rewrite_property_names(schema: Any) -> Any:
    """The schema with every propertyNames that can be said exactly in other keywords so said (a new schema: the
    request's is left as it was)."""
    if isinstance(schema, list):
        return [rewrite_property_names(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in DATA_KEYWORDS:
            out[k] = v
        elif k in SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: rewrite_property_names(s) for name, s in v.items()}
        else:
            out[k] = rewrite_property_names(v)
    return _rewritten(out) if "propertyNames" in out else out


def _rewritten(schema: dict[str, Any]) -> dict[str, Any]:
    names = schema["propertyNames"]
    rest = {k: v for k, v in schema.items() if k != "propertyNames"}
    if names is True or (isinstance(names, dict) and not _constrains_strings(names)):
        return rest
    props, patterns = rest.get("properties", {}), rest.get("patternProperties", {})
    if not isinstance(names, (dict, bool)) or not isinstance(props, dict) or not isinstance(patterns, dict):
        return schema  # not schemas: llguidance's to refuse
    if not isinstance(names, dict) or not _allows_strings(names):  # not a dict here: False (True returned above)
        return _named(rest, [])
    keys = names.keys() - _INERT - {"type"}
    if keys <= {"enum", "const", "minLength", "maxLength"} and keys & {"enum", "const"} and not patterns:
        allowed = _listed(names)
        return schema if allowed is None else _named(rest, allowed)
    extra = rest.get("additionalProperties", True)
    pattern = _pattern(names, keys)
    if pattern is not None and not props and not patterns:
        return {**rest, "patternProperties": {pattern: extra}, "additionalProperties": False}
    return schema


def _named(schema: dict[str, Any], allowed: list[str]) -> dict[str, Any]:
    """The object schema whose only keys are the allowed names. patternProperties are set false (callers pass
    them only with no name allowed): a key a pattern matches is not additional, so additionalProperties false
    alone would not forbid it."""
    props, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
    out = {**schema, "properties": {**{k: False for k in props if k not in allowed},
                                    **{k: props.get(k, extra) for k in allowed}}, "additionalProperties": False}
    if "patternProperties" in schema:
        out["patternProperties"] = dict.fromkeys(schema["patternProperties"], False)
    return out


def _allows_strings(names: dict[str, Any]) -> bool:
    t = names.get("type")
    return t is None or t == "string" or (isinstance(t, list) and "string" in t)


def _constrains_strings(names: dict[str, Any]) -> bool:
    """Whether some string fails the name schema (conservatively: any keyword that could say so counts)."""
    return bool(names.keys() - _INERT - {"type"}) or not _allows_strings(names)


def _pattern(names: dict[str, Any], keys: set[str]) -> str | None:
    """The one regex a name schema of a pattern alone, or of length bounds alone, says (None: neither)."""
    if keys == {"pattern"}:
        return names["pattern"] if isinstance(names["pattern"], str) else None
    low, high = names.get("minLength", 0), names.get("maxLength")
    if keys and keys <= {"minLength", "maxLength"} and _whole(low) and (high is None or _whole(high)):
        return rf"^[\s\S]{{{low},{'' if high is None else high}}}$"  # code points, as minLength counts them
    return None


def _whole(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _listed(names: dict[str, Any]) -> list[str] | None:
    """The names an enum / const schema allows, within its length bounds (lengths in code points, as JSON Schema
    counts them); None when the bounds are not whole numbers."""
    low, high = names.get("minLength", 0), names.get("maxLength")
    if not _whole(low) or not (high is None or _whole(high)) or ("enum" in names and not isinstance(names["enum"],
                                                                                                     list)):
        return None
    values = names["enum"] if "enum" in names else [names["const"]]
    if "const" in names:
        values = [v for v in values if v == names["const"]]
    listed = [v for v in values if isinstance(v, str) and low <= len(v) and (high is None or len(v) <= high)]
    return list(dict.fromkeys(listed))
