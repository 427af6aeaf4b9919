"""Bounds on a client's constraint, checked in Python before any native compiler sees it.

llguidance's compilers recurse in native code: a schema nested 10,000 levels deep, or one whose `required`
lists 30,000 names, overflows the stack and kills the process (SIGSEGV, three times out of three). Compiling in
a sandbox process (ladle.structured_output.sandbox) keeps such a crash to one request; these bounds answer the
shapes known to take the compiler seconds or its stack, or to fail mid-output, at once, with a 400 that names
the bound, before a worker spends anything on them. Every bound sits above what real schemas use (an agent's 24
tools, a country enum) and below where the compiler slows or fails (5,000 required names compile in 0.2 s,
20,000 in 3.3 s, 30,000 crash; measured on an AMD EPYC, llguidance 1.9).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ladle.sampling_params import StructuredOutputsParams
from ladle.structured_output.grammar import InvalidStructuredOutput


@dataclass(frozen=True)
class GrammarLimits:
    max_depth: int = 64  # nesting of objects and arrays in a schema (llguidance refuses past 128 itself)
    # llguidance's Earley parser holds at most 2,000 items in a row and fails the request mid-output past them:
    # a `choice` or an `anyOf` costs an item per alternative (2,100 fail at the second token), an object about 4
    # per property (500 properties fail). These keep a margin below that.
    max_items: int = 1024  # entries of any one array in a schema: required, enum, anyOf
    max_keys: int = 256  # entries of any one object in a schema: properties, $defs
    max_nodes: int = 100_000  # values in a whole schema
    max_choices: int = 1024  # strings of a choice constraint
    max_chars: int = 1 << 20  # characters of a regex, a grammar or a choice's strings together


class ConstraintTooLarge(InvalidStructuredOutput):
    """A constraint past one of GrammarLimits: the message names the bound and where it was passed."""


def check_schema(schema: Any, field: str, limits: GrammarLimits) -> None:
    """Raise ConstraintTooLarge when schema (a parsed JSON value) passes a bound. The walk is iterative, so a
    deep schema cannot overflow Python's stack either."""
    stack: list[tuple[Any, int, str]] = [(schema, 1, "")]
    nodes = 0
    while stack:
        value, depth, where = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            raise ConstraintTooLarge(field, f"the schema has more than {limits.max_nodes} values; this server "
                                     "compiles schemas up to that size")
        if not isinstance(value, (dict, list)):
            continue
        if depth > limits.max_depth:
            raise ConstraintTooLarge(field, f"the schema nests deeper than {limits.max_depth} levels (at "
                                     f"{where or '/'}); this server compiles schemas up to that depth")
        bound, kind = (limits.max_keys, "object") if isinstance(value, dict) else (limits.max_items, "array")
        if len(value) > bound:
            raise ConstraintTooLarge(field, f"{where or 'the schema'} has {len(value)} entries; this server "
                                     f"compiles at most {bound} in one {kind}")
        children = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((child, depth + 1, f"{where}/{key}") for key, child in children)


def check_spec(spec: StructuredOutputsParams, limits: GrammarLimits) -> None:
    """Raise ConstraintTooLarge when spec passes a bound (a schema given as text is parsed for the walk; one
    that is not JSON is left to the compiler's own message)."""
    field = f"structured_outputs.{spec.kind}"
    if spec.kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            _check_chars(field, len(schema), limits)
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):
                return
        check_schema(schema, field, limits)
    elif spec.kind == "choice":
        choices = spec.choice or []
        if len(choices) > limits.max_choices:
            raise ConstraintTooLarge(field, f"{len(choices)} choices; this server compiles at most "
                                     f"{limits.max_choices}")
        _check_chars(field, sum(len(c) for c in choices), limits)
    elif spec.kind in ("regex", "grammar"):
        _check_chars(field, len((spec.regex if spec.kind == "regex" else spec.grammar) or ""), limits)


def _check_chars(field: str, n: int, limits: GrammarLimits) -> None:
    if n > limits.max_chars:
        raise ConstraintTooLarge(field, f"{n} characters; this server compiles constraints of at most "
                                 f"{limits.max_chars}")
