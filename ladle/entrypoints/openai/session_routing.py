"""Which replica serves a request, so that a session's next turn finds its prefix cached (`ladle serve-replicas`).

A coding agent resends its whole conversation every turn; only the replica that served its last turn holds that
prefix. The router keys a request by the session hint its client sends and sends the key's requests to the replica
that served it before; a request with no key goes where the longest part of its prompt was sent before. Load still
counts: a replica far busier than the least busy one is passed over, and the session moves. Ray-free (the Ray
request router in ray_router.py drives it), so it is tested without Ray.

Hints, first found wins (header names compared as Ray's proxy does: any case, `-` and `_` alike):
- `x-session-affinity` header (OpenCode sends it; its purpose is this);
- `prompt_cache_key` (OpenAI chat completions, completions, responses: Codex CLI sends its session id there);
- `metadata.user_id` (Anthropic's Messages API only: Claude Code's carries its session id);
- session headers: `x-claude-code-session-id` (Claude Code), `session-id` / `session_id` / `conversation_id`
  (Codex CLI), `x-session-id` (OpenCode, and Ray Serve's own session header).
"""
from __future__ import annotations

import hashlib
import json
import random
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SESSION_HEADERS = ("x_claude_code_session_id", "session_id", "conversation_id", "x_session_id")
AFFINITY_HEADER = "x_session_affinity"
# The prompt's parts in the order a chat template puts them; each is serialized whole, so a conversation that grows
# at its end keeps the serialization of its earlier turns as a prefix.
PROMPT_FIELDS = ("system", "instructions", "tools", "messages", "input", "prompt")
CHUNK_CHARS = 256  # prefix granularity: a chain of hashes, one per full chunk of the serialized prompt
MAX_CHUNKS = 8192  # 2M characters; a longer prompt is matched on its first 2M


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def session_key(path: str, headers: Mapping[str, str], body: Any) -> str | None:
    """The request's session key from its raw JSON body (the router sees no parsed request), or None.
    metadata.user_id counts only on the Messages API (path), where it is Anthropic's field."""
    key = body.get("prompt_cache_key") if isinstance(body, dict) else None
    meta = body.get("metadata") if isinstance(body, dict) and path.rstrip("/").endswith("/messages") else None
    user = meta.get("user_id") if isinstance(meta, dict) else None
    return session_hint(headers, key if isinstance(key, str) else None, user if isinstance(user, str) else None)


def session_hint(headers: Mapping[str, str], prompt_cache_key: str | None = None,
                 user_id: str | None = None) -> str | None:
    """The session key of a request with these headers and fields (a digest of the hint, so maps keyed by it stay
    small), or None; the hints' order is the module's."""
    h = {_norm(k): v for k, v in headers.items()}
    hint = h.get(AFFINITY_HEADER) or prompt_cache_key or user_id or next((h[n] for n in SESSION_HEADERS if h.get(n)),
                                                                         None)
    return hashlib.blake2b(hint.encode(), digest_size=12).hexdigest() if hint else None


def prefix_chain(body: Any) -> tuple[int, ...]:
    """Chained hashes of the serialized prompt's full CHUNK_CHARS chunks: two prompts share chain[:n] when they
    share their first n chunks (as vLLM's block hashes do for token blocks)."""
    if not isinstance(body, dict):
        return ()
    text = "".join(json.dumps(body[f], ensure_ascii=False, separators=(",", ":")) for f in PROMPT_FIELDS
                   if f in body)
    chain, h = [], b""
    for i in range(0, min(len(text), MAX_CHUNKS * CHUNK_CHARS) - CHUNK_CHARS + 1, CHUNK_CHARS):
        h = hashlib.blake2b(h + text[i:i + CHUNK_CHARS].encode(), digest_size=8).digest()
        chain.append(int.from_bytes(h, "little"))
    return tuple(chain)


def routing_hint(path: str, headers: Mapping[str, str], body_bytes: bytes) -> tuple[str | None, tuple[int, ...]]:
    """(session key, prefix chain) of an HTTP request; a body that is not JSON has neither."""
    try:
        body = json.loads(body_bytes) if body_bytes else None
    except (ValueError, UnicodeDecodeError):
        body = None
    return session_key(path, headers, body), prefix_chain(body)


@dataclass(frozen=True)
class Choice:
    replica: str
    why: str  # session (the key's replica), prefix (the longest cached prefix), or balance (the least loaded)


@dataclass
class AffinityPolicy:
    """Session -> replica, and which prompt prefixes each replica was sent; the load is requests in flight.

    A known key goes to its replica, unless that replica is overloaded (at least imbalance_abs more requests in flight
    than the least loaded one, and imbalance_rel times as many): then, and for a new key, to the least loaded replica
    (ties: fewest sessions, then the longest prefix match), which the key keeps from then on. A request without a key
    goes to the replica with the longest match of its prefix chain when that covers match_threshold of it and the
    replica is not overloaded (SGLang's cache-aware rule), else to the least loaded (ties: fewest cached chunks).
    A new key is balanced rather than matched: its first turn shares only the system prompt with the others, which
    every replica computes once, while its later turns stay where it lands."""
    imbalance_abs: int = 8
    imbalance_rel: float = 2.0
    match_threshold: float = 0.5
    max_sessions: int = 1 << 17
    max_chunks: int = 1 << 18  # per replica (64M characters of prompt), least recently routed dropped first
    seed: int | None = None
    sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    chunks: dict[str, OrderedDict[int, None]] = field(default_factory=dict)
    ongoing: Counter[str] = field(default_factory=Counter)
    owned: Counter[str] = field(default_factory=Counter)  # sessions per replica
    chosen: Counter[str] = field(default_factory=Counter)  # decisions by why, for tests and logs

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(self, replicas: Sequence[str], key: str | None, chain: Sequence[int]) -> Choice:
        if not replicas:
            raise ValueError("no replica to choose from")
        low = min(self.ongoing[r] for r in replicas)

        def overloaded(r: str) -> bool:
            n = self.ongoing[r]
            return n >= low + self.imbalance_abs and n >= self.imbalance_rel * low

        match = {r: self.match(r, chain) for r in replicas}
        choice: Choice | None = None
        if key is not None:
            mine = self.sessions.get(key)
            if mine in match and not overloaded(mine):
                choice = Choice(mine, "session")
        elif chain:
            best = max(match.values())
            if best >= self.match_threshold * len(chain) and best > 0:
                fits = [r for r in replicas if match[r] == best and not overloaded(r)]
                if fits:
                    choice = Choice(min(fits, key=lambda r: (self.ongoing[r], self._rng.random())), "prefix")
        if choice is None:
            choice = Choice(min(replicas, key=lambda r: (self.ongoing[r], self.owned[r] if key else 0, -match[r],
                                                         len(self.chunks.get(r, ())), self._rng.random())), "balance")
        self._record(choice.replica, key, chain)
        self.chosen[choice.why] += 1
        return choice

    def match(self, replica: str, chain: Sequence[int]) -> int:
        """How many leading chunks of chain were sent to replica (the chain is prefix-closed, so a bisection)."""
        seen = self.chunks.get(replica)
        if not seen or not chain:
            return 0
        lo, hi = 0, len(chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _record(self, replica: str, key: str | None, chain: Sequence[int]) -> None:
        if key is not None:
            old = self.sessions.pop(key, None)
            if old is not None:
                self.owned[old] -= 1
            self.sessions[key] = replica
            self.owned[replica] += 1
            while len(self.sessions) > self.max_sessions:
                _, gone = self.sessions.popitem(last=False)
                self.owned[gone] -= 1
        seen = self.chunks.setdefault(replica, OrderedDict())
        for h in chain:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_chunks:
            seen.popitem(last=False)

    def started(self, replica: str) -> None:
        self.ongoing[replica] += 1

    def finished(self, replica: str) -> None:
        self.ongoing[replica] = max(0, self.ongoing[replica] - 1)

    def keep(self, replicas: Iterable[str]) -> None:
        """Forget replicas that are gone: their sessions are new keys again, their prefixes unknown."""
        live = set(replicas)
        for key in [k for k, r in self.sessions.items() if r not in live]:
            del self.sessions[key]
        for gone in [r for r in self.chunks if r not in live]:
            del self.chunks[gone]
        for counter in (self.ongoing, self.owned):
            for gone in [r for r in counter if r not in live]:
                del counter[gone]
