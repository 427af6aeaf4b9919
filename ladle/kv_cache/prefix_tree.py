"""The prefix cache's identities: one node per distinct prefix of full token blocks (a radix tree, one block of
tokens per edge), shared by every KV cache group and the state checkpoints.

Node k of a request names its tokens [0, (k + 1) x block_size). A group's cached block and a state checkpoint are
registered under the node of the prefix they hold, so each is found without the others: a sliding-window
group's block past the window is served even after the blocks before it were evicted, and a checkpoint outlives
the blocks it ends.

Identities are exact: a node is looked up by its parent's id and its own token ids, compared on every hit, and
node ids are never reused, so no hash collision (even a constant hash) can serve another prefix.

A node lives while anything refers to it: a cached block or checkpoint registered under it, a child node, or a
request whose chain passes through it. When the last goes, it goes, and its parent loses a reference.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

ROOT = -1  # the parent of a request's first block


def hash_block_tokens(parent: int, tokens_hash: int) -> int:
    """Hash of a node's key. A module function, so tests can make it collide on purpose."""
    return hash((parent, tokens_hash))


@dataclass(frozen=True)
class BlockTokens:
    """A full block's token ids and their hash, made once per request and block (Request.block_tokens), so the
    lookups each step repeats for a waiting prompt hash only the parent's id."""

    token_ids: tuple[int, ...]
    tokens_hash: int


@dataclass(frozen=True, eq=True)
class NodeKey:
    parent: int
    tokens: BlockTokens

    def __hash__(self) -> int:
        return hash_block_tokens(self.parent, self.tokens.tokens_hash)


class PrefixTree:
    def __init__(self) -> None:
        self._ids: dict[NodeKey, int] = {}
        self._keys: dict[int, NodeKey] = {}
        self._refs: dict[int, int] = {}
        self._next_id = itertools.count()

    def walk(self, keys: list[BlockTokens]) -> list[int]:
        """The nodes of the longest known prefix of these blocks."""
        nodes: list[int] = []
        parent = ROOT
        for tokens in keys:
            node = self._ids.get(NodeKey(parent, tokens))
            if node is None:
                break
            nodes.append(node)
            parent = node
        return nodes

    def extend(self, parent: int, tokens: BlockTokens) -> int:
        """The child of parent with these tokens, made if new, with a reference taken for the caller."""
        key = NodeKey(parent, tokens)
        node = self._ids.get(key)
        if node is None:
            node = next(self._next_id)
            self._ids[key], self._keys[node], self._refs[node] = node, key, 0
            if parent != ROOT:
                self._refs[parent] += 1
        self._refs[node] += 1
        return node

    def ref(self, node: int) -> None:
        self._refs[node] += 1

    def unref(self, node: int) -> None:
        while node != ROOT:
            self._refs[node] -= 1
            if self._refs[node]:
                return
            key = self._keys.pop(node)
            del self._ids[key], self._refs[node]
            node = key.parent

    def refs(self, node: int) -> int:
        return self._refs.get(node, 0)
