"""A JSON schema's local refs ("#/$defs/A", "#") when the schema moves: into a larger document (a tool's
parameters inside the schema of one call), or out of one (a single parameter, compiled on its own).

A local ref resolves against the root of the document it sits in. pydantic's and zod's nested models are all
$defs and refs, so a schema placed anywhere but the root points nowhere ("Pointer '/$defs/A' does not exist")
unless its refs move with it. llguidance resolves any JSON pointer into the document, recursion included, so
moving a ref is rewriting its pointer.
"""
from __future__ import annotations

from typing import Any, TypeGuard
from urllib.parse import unquote

# Keywords whose values are JSON data, not schemas: a "$ref" inside them is no ref.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas: their keys are names, never keywords.
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"})
# Keywords that say what a schema is, not what it allows: two schemas that share only these can be laid one over
# the other (see deref).
NON_CONSTRAINING = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                              "$comment", "$schema", "$id", "$anchor", "$defs", "definitions"})
_CARRIED = "ladle_root"  # standalone's key for the document a part was cut from
_MAX_DEPTH = 16  # deref's descent through alternatives: far past real schemas, short of Python's stack


def is_local(ref: Any) -> TypeGuard[str]:
    """A ref into the document itself by JSON pointer ("#", "#/..."); "#name" (an anchor) is found by name."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def relocate(schema: Any, at: str) -> Any:
    """schema as placed at JSON pointer `at` (e.g. "/anyOf/0/properties/arguments") of a larger document: every
    local ref rewritten to point to the same place under `at`. The root's $id goes, since its refs now resolve
    through the larger document; a subschema with an $id of its own is a resource its refs resolve against, so
    they stay."""
    if isinstance(schema, dict):
        schema = {k: v for k, v in schema.items() if k != "$id"}
    return _moved(schema, at)


def _moved(value: Any, at: str) -> Any:
    if isinstance(value, list):
        return [_moved(v, at) for v in value]
    if not isinstance(value, dict) or isinstance(value.get("$id"), str):
        return value
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k == "$ref" and is_local(v):
            out[k] = "#" + at + v[1:]
        elif k in DATA_KEYWORDS:
            out[k] = v
        elif k in SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _moved(s, at) for name, s in v.items()}
        else:
            out[k] = _moved(v, at)
    return out


def has_local_ref(value: Any) -> bool:
    if isinstance(value, list):
        return any(has_local_ref(v) for v in value)
    if not isinstance(value, dict):
        return False
    for k, v in value.items():
        if k == "$ref":
            if is_local(v):
                return True
        elif k in SCHEMA_MAPS and isinstance(v, dict):
            if any(has_local_ref(s) for s in v.values()):
                return True
        elif k not in DATA_KEYWORDS and has_local_ref(v):
            return True
    return False


def standalone(schema: Any, root: Any) -> Any:
    """A document that holds a value to schema, where schema is a part of root (its local refs resolve against
    root), compiled on its own: root rides along in the document's $defs and the refs point into it there. A
    schema with no local refs is its own document, returned as it is."""
    if not isinstance(schema, dict) or isinstance(schema.get("$id"), str) or not has_local_ref(schema):
        return schema  # (a schema with an $id is a resource of its own: its refs resolve against it)
    at = f"/$defs/{_CARRIED}"
    # Its own $defs go: every ref reaches them through root's copy, where they sit too.
    doc = {k: v for k, v in _moved(schema, at).items() if k != "$defs"}
    return {**doc, "$defs": {_CARRIED: relocate(root, at)}}


def resolve(ref: str, root: Any) -> Any | None:
    """What a local ref points to in root (None when nothing is there): JSON pointer segments, percent-decoded,
    with ~1 for "/" and ~0 for "~"."""
    if not is_local(ref):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def deref(schema: Any, root: Any, _seen: frozenset[str] = frozenset(), _depth: int = 0) -> Any:
    """The schema with its own ref followed (and a lone allOf member, pydantic v1's way of giving a ref a
    description), the ref's siblings laid over the target, and each anyOf / oneOf / allOf member so treated:
    enough to read what kind of value the schema allows. Nested schemas (properties, items) keep their refs. A
    ref that points nowhere, or back into the chain that reached it, stays."""
    if not isinstance(schema, dict) or _depth > _MAX_DEPTH:
        return schema
    ref = schema.get("$ref")
    if is_local(ref) and ref not in _seen and isinstance(target := resolve(ref, root), (dict, bool)):
        target = {} if target is True else {"not": {}} if target is False else target
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return _overlay(deref(target, root, _seen | {ref}, _depth + 1), deref(rest, root, _seen, _depth + 1))
    one = schema.get("allOf")
    if isinstance(one, list) and len(one) == 1 and isinstance(one[0], dict):
        rest = {k: v for k, v in schema.items() if k != "allOf"}
        return _overlay(deref(one[0], root, _seen, _depth + 1), deref(rest, root, _seen, _depth + 1))
    out = dict(schema)
    for k in ("anyOf", "oneOf", "allOf"):
        if isinstance(out.get(k), list):
            out[k] = [deref(alt, root, _seen, _depth + 1) for alt in out[k]]
    return out


def _overlay(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Both schemas at once: top's keys over base's where only descriptions clash, else both as an allOf."""
    if (base.keys() & top.keys()) - NON_CONSTRAINING:
        return {"allOf": [base, top]}
    return {**base, **top}
