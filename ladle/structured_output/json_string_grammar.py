"""A Lark grammar over raw text, rewritten over that text as it stands inside a JSON string.

A custom tool's input (Codex's apply_patch, held to a Lark grammar) reaches the client raw, but a JSON tool-call
format (hermes, llama3_json) writes it as a JSON string's contents: a newline as \\n, a quote as \\", and so on.
Escaping is a homomorphism (each character becomes a fixed text: json.dumps's, the short escapes \\" \\\\ \\b \\f
\\n \\r \\t and \\u00XX for the other control characters, every other character itself), so the escaped language
is the grammar with each terminal replaced by its image: string literals are escaped, and each regex becomes a
rule of the same shape in which every character class is its characters that stand as themselves, or'ed with
the escapes of the others. A text the rewritten grammar accepts is the escaped form of a text the client's
grammar accepts, and json.loads reads it back to that text.

Escapes are lexemes of their own, and terminals become rules (named t__<name>): llguidance lexes greedily, so a
lexeme that could go on with an escape's backslash would never end before one that begins with it (a filename
followed by \\n), while a run of plain characters always ends at a backslash. What cannot be rewritten so is
refused by name (UnsupportedGrammar): special tokens, %json, %lark and %regex blocks, grammar references,
%ignore (it would fall between the pieces of a terminal), the & and ~ operators, regex anchors, lookaround and
backreferences, class set operations, and %import of terminals other than Lark's common ones in COMMON.
"""
from __future__ import annotations

import json
import re

# Python's regex parser reads the part of Rust's regex dialect (llguidance's) rewritten here; what the two
# read differently (class set operations, \p{..}, \x{..}) is refused before it is parsed.
import re._constants as sre  # noqa: E402
import re._parser as sre_parse  # noqa: E402
import warnings
from typing import Any

from ladle.structured_output.limits import GrammarLimits

_ESCAPED = frozenset(chr(c) for c in range(0x20)) | {'"', "\\"}  # what a JSON string cannot hold as itself
_PLAIN = r"[^\x{0}-\x{1F}\x{22}\x{5C}]"  # every character that stands as itself
_SPACE = frozenset("\t\n\x0b\x0c\r")  # the escaped characters Rust's \s matches (White_Space)

# Lark's common.lark terminals that grammars %import (Codex's apply_patch imports LF), in Lark's own syntax.
COMMON: dict[str, str] = {
    "DIGIT": '"0".."9"', "HEXDIGIT": '"a".."f"|"A".."F"|DIGIT', "INT": "DIGIT+",
    "SIGNED_INT": '["+"|"-"] INT', "DECIMAL": 'INT "." INT? | "." INT', "_EXP": '("e"|"E") SIGNED_INT',
    "FLOAT": "INT _EXP | DECIMAL _EXP?", "SIGNED_FLOAT": '["+"|"-"] FLOAT', "NUMBER": "FLOAT | INT",
    "SIGNED_NUMBER": '["+"|"-"] NUMBER', "LCASE_LETTER": '"a".."z"', "UCASE_LETTER": '"A".."Z"',
    "LETTER": "UCASE_LETTER | LCASE_LETTER", "WORD": "LETTER+", "CNAME": '("_"|LETTER) ("_"|LETTER|DIGIT)*',
    "WS_INLINE": '(" "|/\\t/)+', "WS": "/[ \\t\\f\\r\\n]/+", "CR": "/\\r/", "LF": "/\\n/",
    "NEWLINE": "(CR? LF)+",
}
_TERMINAL = re.compile(r"_?[A-Z][_A-Z0-9]*")

_TOKEN = re.compile(r"""
    (?P<comment>(?:\#|//)[^\n]*)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[a-z]*)
  | (?P<range>\.\.)
  | (?P<directive>%[a-z]+)
  | (?P<special><[^<>\s]+>)
  | (?P<ref>@[A-Za-z0-9_]+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<other>[\s\S])
""", re.VERBOSE)
_REFUSED = {"%json": "%json blocks", "%lark": "%lark blocks", "%regex": "%regex blocks",
            "%llguidance": "%llguidance options", "%override": "%override", "%declare": "%declare", "%if": "%if",
            "%ignore": "%ignore (it would fall between the pieces of a rewritten terminal)"}
_IMPORT = re.compile(r"%import\s+common\s*(?:\.\s*([A-Z_][A-Z0-9_]*)|\(([^)]*)\))[ \t]*(?:->[ \t]*([A-Z_]\w*))?")


class UnsupportedGrammar(ValueError):
    """What in a grammar cannot be rewritten for a JSON string; the message names it."""


# A custom tool's grammar is rewritten in the API process as its request is read (Codex's apply_patch has 700
# characters; rewriting 16K of distinct classes takes some 0.1 s, a megabyte of them seconds).
MAX_INPUT_CHARS = 16_384


def json_string_grammar(lark: str, max_chars: int = GrammarLimits().max_chars) -> str:
    """The Lark grammar of the JSON-escaped texts of lark's language (see the module's docstring); it may not
    pass max_chars (a class becomes some 1,500 characters, so a small grammar of many classes could become a
    huge one)."""
    if len(lark) > MAX_INPUT_CHARS:
        raise UnsupportedGrammar(f"the grammar has {len(lark)} characters; this server rewrites grammars of at most "
                                 f"{MAX_INPUT_CHARS} for a JSON string")
    budget = _Budget(max_chars)
    out: list[str] = []
    tokens = [(m.lastgroup or "", m.group()) for m in _TOKEN.finditer(_expand_imports(lark))]
    i = 0
    while i < len(tokens):
        kind, value = tokens[i]
        dots = _next_solid(tokens, i + 1)
        if kind == "string" and tokens[dots][0] == "range":  # "a".."z": a class
            last = _next_solid(tokens, dots + 1)
            low = _lark_string(value)
            high = _lark_string(tokens[last][1]) if tokens[last][0] == "string" else ""
            if len(low) != 1 or len(high) != 1:
                raise UnsupportedGrammar(f"a range must join two one-character strings: {value} .. "
                                         f"{tokens[last][1][:20]}")
            out.append(_Rewriter(False, False, budget).charset([(sre.RANGE, (ord(low), ord(high)))], False))
            i = last + 1
            continue
        if kind == "string":
            out.append(_string(value, budget))
        elif kind == "regex":
            out.append(_regex(value, budget))
        elif kind == "name" and _TERMINAL.fullmatch(value):
            out.append(f"t__{value.lower()}")  # a terminal is a rule now: its escapes are lexemes of their own
        elif kind == "directive" and value in _REFUSED:
            raise UnsupportedGrammar(f"{_REFUSED[value]} cannot be rewritten for a JSON string")
        elif kind == "special":
            raise UnsupportedGrammar(f"special tokens ({value}) cannot stand inside a JSON string")
        elif kind == "ref":
            raise UnsupportedGrammar(f"grammar references ({value}) cannot be rewritten for a JSON string")
        elif kind == "other" and value in "&~":
            raise UnsupportedGrammar(f"the {value} operator cannot be rewritten for a JSON string")
        else:
            out.append(value)
        i += 1
    return "".join(out)


def _next_solid(tokens: list[tuple[str, str]], i: int) -> int:
    """The index of the next token from i that is not a space or a tab (the last token's, past the end)."""
    while i < len(tokens) and tokens[i][0] == "other" and tokens[i][1] in " \t":
        i += 1
    return min(i, len(tokens) - 1)


def _expand_imports(lark: str) -> str:
    """%import common.X lines replaced by X's definition from COMMON (and those it uses), so the terminals are
    rewritten with the rest."""
    defined: dict[str, str] = {}

    def need(name: str, alias: str | None = None) -> None:
        if name not in COMMON:
            raise UnsupportedGrammar(f"%import common.{name}: only Lark's common terminals "
                                     f"{', '.join(COMMON)} can be rewritten for a JSON string")
        if (alias or name) in defined:
            return
        defined[alias or name] = COMMON[name]
        for used in _TERMINAL.findall(re.sub(r'"[^"]*"|/[^/]*/', "", COMMON[name])):  # names, not literals
            need(used)

    def replace(m: re.Match[str]) -> str:
        names = [m.group(1)] if m.group(1) else [n.strip() for n in m.group(2).split(",") if n.strip()]
        for name in names:
            need(name, m.group(3) if m.group(1) else None)
        return ""

    body = _IMPORT.sub(replace, lark)
    if re.search(r"^\s*%import\b", body, re.MULTILINE):
        raise UnsupportedGrammar("%import of anything but Lark's common terminals cannot be rewritten")
    return body + "".join(f"\n{name}: {definition}" for name, definition in defined.items()) + "\n"


def _lark_string(token: str) -> str:
    """A Lark string literal's text (its escapes are JSON's, and \\xXX)."""
    body = token[:-1] if token.endswith("i") else token
    body = re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: f"\\u00{m.group(1)}", body)
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise UnsupportedGrammar(f"the string {token[:40]} cannot be read") from None


def _literal(text: str) -> str:
    """A Lark string literal of the escaped form of text (a Lark string cannot hold DEL itself)."""
    return json.dumps(json.dumps(text, ensure_ascii=False)[1:-1], ensure_ascii=False).replace("\x7f", "\\u007f")


def _string(token: str, budget: _Budget) -> str:
    text = _lark_string(token)
    if token.endswith("i"):  # case-insensitive: the letters of the escapes themselves keep their case
        return _Rewriter(True, False, budget).seq(list(sre_parse.parse(re.escape(text), 0)))
    return _literal(text)


def _regex(token: str, budget: _Budget) -> str:
    end = token.rindex("/")
    body, flags = token[1:end], token[end + 1:]
    bad = sorted(set(flags) - set("isx"))
    if bad:
        raise UnsupportedGrammar(f"the regex flag {bad[0]!r} in {token[:40]} cannot be rewritten")
    if re.search(r"\\[pPxu]\{|\[\[|&&|--|~~|\[:", body):
        raise UnsupportedGrammar(f"the regex {token[:40]} uses syntax (\\p{{..}}, \\x{{..}}, nested or combined "
                                 "classes) that cannot be rewritten for a JSON string")
    py_flags = (re.IGNORECASE if "i" in flags else 0) | (re.VERBOSE if "x" in flags else 0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a FutureWarning marks syntax Python reads differently
            parsed = sre_parse.parse(body.replace("\\/", "/"), py_flags)
    except (re.error, FutureWarning, DeprecationWarning, OverflowError, RecursionError, ValueError) as e:
        raise UnsupportedGrammar(f"the regex {token[:40]} cannot be read ({str(e)[:80]})") from None
    seen = parsed.state.flags
    return _Rewriter(bool(seen & re.IGNORECASE), bool(seen & re.DOTALL) or "s" in flags, budget).seq(list(parsed))


def _char(c: str) -> str:
    """One character in a regex: letters and digits as themselves, anything else by its code (never a bare
    slash, which would end the Lark regex)."""
    return c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}"


class _Budget:
    """The characters a rewrite may still write in classes (what else it writes is bounded by its input's)."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars, self.left = max_chars, max_chars
        self.classes: dict[Any, str] = {}  # each class rewritten once: grammars repeat theirs

    def spend(self, text: str) -> str:
        self.left -= len(text)
        if self.left < 0:
            raise UnsupportedGrammar(f"rewritten for a JSON string, the grammar passes {self.max_chars} characters, "
                                     "the most this server compiles")
        return text


class _Rewriter:
    """Rebuilds a parsed regex as a Lark expression over escaped text."""

    def __init__(self, ignorecase: bool, dotall: bool, budget: _Budget) -> None:
        self.ignorecase, self.dotall, self.budget = ignorecase, dotall, budget

    def seq(self, items: list[tuple[Any, Any]]) -> str:
        parts: list[str] = []
        run = ""  # consecutive literal characters: one string literal
        for op, av in items:
            if op is sre.LITERAL and not (self.ignorecase and chr(av).lower() != chr(av).upper()):
                run += chr(av)
                continue
            if run:
                parts.append(_literal(run))
                run = ""
            parts.append(self.node(op, av))
        if run:
            parts.append(_literal(run))
        return "(" + " ".join(parts) + ")" if parts else '""'

    def node(self, op: Any, av: Any, runs: bool = False) -> str:
        """runs: a class matches runs of its plain characters (it is repeated)."""
        if op is sre.LITERAL:
            return self.charset([(op, av)], False)
        if op is sre.NOT_LITERAL:
            return self.charset([(sre.LITERAL, av)], True, runs)
        if op is sre.ANY:
            return self.charset([] if self.dotall else [(sre.LITERAL, ord("\n"))], True, runs)
        if op is sre.IN:
            negate = bool(av) and av[0][0] is sre.NEGATE
            return self.charset(av[1:] if negate else av, negate, runs)
        if op is sre.BRANCH:
            return "(" + " | ".join(self.seq(list(b)) for b in av[1]) + ")"
        if op is sre.SUBPATTERN:
            _, add, remove, sub = av
            if add or remove:
                raise UnsupportedGrammar("inline regex flags inside a group cannot be rewritten")
            return self.seq(list(sub))
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            low, high, sub = av
            only = list(sub)
            if len(only) == 1 and only[0][0] in (sre.IN, sre.ANY, sre.NOT_LITERAL) and low in (0, 1) \
                    and high is sre.MAXREPEAT:
                # A class repeated: its plain characters in runs, one lexeme each, not one lexeme a character.
                item_op, item_av = only[0]
                return self.node(item_op, item_av, runs=True) + ("*" if low == 0 else "+")
            bound = f"{{{low},}}" if high is sre.MAXREPEAT else f"{{{low},{high}}}"
            return self.seq(only) + bound
        raise UnsupportedGrammar(f"regex {str(op).lower()} (anchors, lookaround, backreferences) cannot be "
                                 "rewritten for a JSON string")

    def charset(self, items: list[tuple[Any, Any]], negate: bool, runs: bool = False) -> str:
        """A character class: a lexeme of its characters that stand as themselves (runs of them, with runs),
        or'ed with the escapes of its others, each a lexeme."""
        key = (tuple(items), negate, runs, self.ignorecase)
        if key not in self.budget.classes:
            self.budget.classes[key] = self._charset(items, negate, runs)
        return self.budget.spend(self.budget.classes[key])

    def _charset(self, items: list[tuple[Any, Any]], negate: bool, runs: bool) -> str:
        escaped = sorted(c for c in _ESCAPED if self._member(items, c) != negate)
        parts = []
        if negate or not all(self._within_escaped(op, av) for op, av in items):
            inner = "".join(self._class_item(op, av) for op, av in items)
            cls = f"[{'^' if negate else ''}{inner}]" if inner else "[\\x{0}-\\x{10FFFF}]"
            cls = f"[{cls}&&{_PLAIN}]" + ("+" if runs else "")
            parts.append(f"/(?i:{cls})/" if self.ignorecase else f"/{cls}/")
        parts += [_literal(c) for c in escaped]
        if not parts:
            raise UnsupportedGrammar("a regex class matches no character")
        return "(" + " | ".join(parts) + ")"

    @staticmethod
    def _within_escaped(op: Any, av: Any) -> bool:
        if op is sre.LITERAL:
            return chr(av) in _ESCAPED
        if op is sre.RANGE:
            return all(chr(c) in _ESCAPED for c in range(av[0], av[1] + 1))
        return False

    @staticmethod
    def _class_item(op: Any, av: Any) -> str:
        if op is sre.LITERAL:
            return _char(chr(av))
        if op is sre.RANGE:
            return f"{_char(chr(av[0]))}-{_char(chr(av[1]))}"
        names = {sre.CATEGORY_DIGIT: "\\d", sre.CATEGORY_NOT_DIGIT: "\\D", sre.CATEGORY_SPACE: "\\s",
                 sre.CATEGORY_NOT_SPACE: "\\S", sre.CATEGORY_WORD: "\\w", sre.CATEGORY_NOT_WORD: "\\W"}
        if op is sre.CATEGORY and av in names:
            return names[av]
        raise UnsupportedGrammar(f"the regex class item {str(op).lower()} cannot be rewritten")

    @staticmethod
    def _member(items: list[tuple[Any, Any]], c: str) -> bool:
        """Whether an escaped character c (a control character, a quote or a backslash) is in the class, as
        Rust's regex reads it (\\d and \\w hold none of them, \\s the five spaces)."""
        for op, av in items:
            if op is sre.LITERAL and chr(av) == c:
                return True
            if op is sre.RANGE and av[0] <= ord(c) <= av[1]:
                return True
            if op is sre.CATEGORY and ((av is sre.CATEGORY_SPACE and c in _SPACE)
                                       or (av is sre.CATEGORY_NOT_SPACE and c not in _SPACE)
                                       or av in (sre.CATEGORY_NOT_DIGIT, sre.CATEGORY_NOT_WORD)):
                return True
        return False
