"""Session-aware retention of the prefix cache: what a live session will send again is evicted after everything
else.

A coding agent resends its conversation every turn; a client names the session it belongs to (OpenAI's
prompt_cache_key, Anthropic's metadata.user_id, session headers: ladle.entrypoints.openai.session_routing). When a
session's request ends, the prefix nodes of its full blocks (prompt and reply: the next turn resends both) become
the session's kept nodes, and its deepest state checkpoint (for a model with per-request state: the latest
message end or prompt end the turn saved, where the next turn resumes) its kept checkpoint, replacing those of its
previous turn. The checkpoints of earlier turns are not kept: a hit needs only the deepest one on its path, and
keeping each turn's would fill the checkpoint slots with one session's. A cached block or host-tier entry keyed by a
kept node, or a kept checkpoint, is evicted only when nothing unkept is left to evict, so a burst of one-off
requests cannot flush the sessions, and the shared system + tools prefix, kept by every session that uses it,
stays while any of them lives.

Keeping only reorders eviction: a kept entry is still evicted when nothing else is left, and which entry is served
never changes a token (every hit is exact). A session lapses `ttl_s` after its last request ends (Anthropic's
default prompt-cache lifetime is five minutes), or when more than `max_sessions` are live (the least recently
active goes first); its nodes then rank as plain least-recently-used entries again.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

SESSION_TTL_S = 300.0
MAX_SESSIONS = 4096


class SessionRetention:
    def __init__(self, on_change: Callable[[int, bool], None], ttl_s: float = SESSION_TTL_S,
                 max_sessions: int = MAX_SESSIONS, clock: Callable[[], float] = time.monotonic) -> None:
        """on_change(node, kept): a node became kept by some session, or no session keeps it any more."""
        if ttl_s <= 0 or max_sessions < 1:
            raise ValueError(f"session retention needs ttl_s > 0 and max_sessions >= 1, got {ttl_s}, {max_sessions}")
        self.on_change = on_change
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        # Per session, least recently active first: its kept nodes, its kept checkpoint's node (-1: none) and when
        # its last request ended.
        self._sessions: OrderedDict[str, tuple[tuple[int, ...], int, float]] = OrderedDict()
        self._counts: dict[int, int] = {}  # node -> sessions keeping its blocks
        self._checkpoints: dict[int, int] = {}  # node -> sessions keeping its checkpoint
        self.num_lapsed = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def kept(self, node: int) -> bool:
        return node in self._counts

    def kept_checkpoint(self, node: int) -> bool:
        return node in self._checkpoints

    @property
    def num_kept_nodes(self) -> int:
        return len(self._counts)

    def record(self, session: str, nodes: Sequence[int], checkpoint: int = -1) -> None:
        """The session's latest request ended with these prefix nodes and its deepest state checkpoint under
        `checkpoint` (-1: none): they are what it keeps now."""
        old, old_checkpoint, _ = self._sessions.pop(session, ((), -1, 0.0))
        if checkpoint != old_checkpoint:
            if checkpoint >= 0:
                self._checkpoints[checkpoint] = self._checkpoints.get(checkpoint, 0) + 1
            if old_checkpoint >= 0:
                self._drop_checkpoint(old_checkpoint)
        new = tuple(dict.fromkeys(nodes))
        kept, dropped = set(new) - set(old), set(old) - set(new)
        for node in new:
            if node in kept:
                self._keep(node)
        self._unkeep_all(n for n in old if n in dropped)
        self._sessions[session] = (new, checkpoint, self.clock())
        while len(self._sessions) > self.max_sessions:
            self._lapse(next(iter(self._sessions)))

    def expire(self) -> None:
        """Lapse the sessions idle for more than ttl_s (the least recently active are first: O(1) when none is)."""
        now = self.clock()
        while self._sessions:
            session, (_, _, last) = next(iter(self._sessions.items()))
            if now - last <= self.ttl_s:
                return
            self._lapse(session)

    def clear(self) -> None:
        while self._sessions:
            self._lapse(next(iter(self._sessions)))

    def _lapse(self, session: str) -> None:
        nodes, checkpoint, _ = self._sessions.pop(session)
        self._unkeep_all(nodes)
        if checkpoint >= 0:
            self._drop_checkpoint(checkpoint)
        self.num_lapsed += 1

    def _drop_checkpoint(self, node: int) -> None:
        count = self._checkpoints[node] - 1
        if count:
            self._checkpoints[node] = count
        else:
            del self._checkpoints[node]

    def _keep(self, node: int) -> None:
        count = self._counts.get(node, 0)
        self._counts[node] = count + 1
        if not count:
            self.on_change(node, True)

    def _unkeep_all(self, nodes: Iterable[int]) -> None:
        """In prefix order, so a pool that puts each unkept block first ends with the deepest first: a prefix
        loses its tail before its head."""
        for node in nodes:
            count = self._counts[node] - 1
            if count:
                self._counts[node] = count
            else:
                del self._counts[node]
                self.on_change(node, False)
