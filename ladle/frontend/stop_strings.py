"""Stop-string matching in time linear in the generated text, however many stop strings a request has.

Running `str.find` once per stop string on every update costs O(#stop strings) per token: 380,000 stop
strings made one n=8, 32-token request take a minute. An Aho-Corasick automaton instead finds, one
character at a time, the stop strings that end at that character, in amortized O(1) steps per character.

`StopMatcher` is the automaton, built once per request in O(total length of the stop strings) and never
changed afterwards, so the n choices of a request share it. `StopScanner` is one choice's place in it.

Memory: the trie of 380,000 random 10-char strings has millions of nodes, too many for a dict each. Nodes
are numbered as they are created, so a node's first child is usually the next node: that edge ("chain")
is one code point per node in an int array, and only the other edges (at most one per stop string) live
in per-node dicts. Fail links and longest-match lengths are int arrays too.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterable

_NO_CHAIN = -1  # chain[u] when node u + 1 is not a child of u


class StopMatcher:
    """Aho-Corasick automaton over a request's stop strings (empty ones dropped, duplicates harmless).
    Immutable once built: share it between the detokenizers of one request's choices."""

    __slots__ = ("_branch", "_chain", "_fail", "_longest", "_root", "max_len", "num_nodes")

    def __init__(self, stop: Iterable[str]) -> None:
        chain = array("i", [_NO_CHAIN])  # chain[u]: the code point of the edge u -> u + 1
        branch: dict[int, dict[int, int]] = {}  # branch[u][code point]: u's other children
        longest = array("i", [0])  # longest[u]: the longest stop string that is a suffix of u's string
        for s in stop:
            u, d = 0, 0
            for ch in s:  # walk the part of s already in the trie
                c = ord(ch)
                if chain[u] == c:
                    u += 1
                else:
                    kids = branch.get(u)
                    if kids is None or c not in kids:
                        break
                    u = kids[c]
                d += 1
            if d < len(s):  # the rest of s becomes a run of new nodes, each the chain child of the last
                branch.setdefault(u, {})[ord(s[d])] = len(chain)
                chain.extend(map(ord, s[d + 1 :]))
                chain.append(_NO_CHAIN)
                longest.extend([0] * (len(s) - d))
                u = len(chain) - 1
            if s:
                longest[u] = len(s)
        self._chain, self._branch, self._longest = chain, branch, longest
        self._root = dict(branch.get(0, {}))  # all the root's children: the chase ends there
        if chain[0] != _NO_CHAIN:
            self._root[chain[0]] = 1
        self.num_nodes = len(chain)
        self.max_len = max(longest)  # 0: no stop strings
        self._fail = self._link()

    def _link(self) -> array:
        """Fail links, breadth first; longest[] then also covers stop strings ending at a suffix. O(total
        length): on one stop string's path, each chase step shortens the fail target, each char adds one."""
        chain, branch, longest, root = self._chain, self._branch, self._longest, self._root
        fail = array("i", [0]) * len(chain)
        queue = array("i", root.values())  # depth-1 nodes fail to the root; iterated while it grows
        for u in queue:
            kids = branch.get(u)
            edges = list(kids.items()) if kids is not None else []
            if chain[u] != _NO_CHAIN:
                edges.append((chain[u], u + 1))
            for c, v in edges:
                queue.append(v)
                f = fail[u]
                while f:  # the longest proper suffix of u's string that c extends
                    if chain[f] == c:
                        w = f + 1
                        break
                    f_kids = branch.get(f)
                    if f_kids is not None and c in f_kids:
                        w = f_kids[c]
                        break
                    f = fail[f]
                else:
                    w = root.get(c, 0)
                fail[v] = w
                if not longest[v]:
                    longest[v] = longest[w]
        return fail

    def scanner(self) -> StopScanner:
        return StopScanner(self)


class StopScanner:
    """One choice's scan state over a shared StopMatcher: the automaton node after the text fed so far."""

    __slots__ = ("matcher", "node", "steps")

    def __init__(self, matcher: StopMatcher) -> None:
        self.matcher = matcher
        self.node = 0
        self.steps = 0  # transitions taken, one per char plus one per fail link followed: the work done

    def feed(self, text: str, report: bool = True) -> tuple[int, int] | None:
        """Scan text, which continues the text fed before. With report, stop at the first char where a stop
        string ends and return (offset just past that char in text, length of the longest stop string
        ending there); without, only advance: matches ending in this text are never reported."""
        m = self.matcher
        chain, branch, fail, longest = m._chain, m._branch, m._fail, m._longest
        u, steps = self.node, 0
        for i, ch in enumerate(text):
            c = ord(ch)
            while True:
                steps += 1
                if chain[u] == c:
                    u += 1
                    break
                kids = branch.get(u)
                if kids is not None and c in kids:
                    u = kids[c]
                    break
                if not u:
                    break
                u = fail[u]
            if report and longest[u]:
                self.node, self.steps = u, self.steps + steps
                return i + 1, longest[u]
        self.node, self.steps = u, self.steps + steps
        return None
