"""Session routing's policy (ladle/entrypoints/openai/session_routing.py), without Ray: which hint keys a request
(the released agent CLIs' recorded requests included), a session sticks to its replica unless that one is far
busier, new sessions spread, and keyless requests follow their longest routed prefix."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ladle.entrypoints.openai.session_routing import AffinityPolicy, prefix_chain, routing_hint, session_key

RECORDED = Path(__file__).parent / "fixtures" / "agent_requests"


@pytest.mark.parametrize("name", ["claude-code-2.1.197", "codex-0.171.0", "opencode-1.18.33"])
def test_each_agent_client_sends_a_session_key(name):
    req = json.loads((RECORDED / f"{name}.json").read_text())
    key, chain = routing_hint(req["path"].split("?")[0], req["headers"], json.dumps(req["body"]).encode())
    assert key is not None and len(chain) > 10  # their system prompts alone are thousands of characters
    # The same session's next turn (another message appended) has the same key and extends the chain.
    body = dict(req["body"])
    turns = "messages" if "messages" in body else "input"
    body[turns] = [*body[turns], {"role": "user", "content": "next turn " * 100}]
    key2, chain2 = routing_hint(req["path"].split("?")[0], req["headers"], json.dumps(body).encode())
    assert key2 == key and chain2[:len(chain) - 1] == chain[:-1] and len(chain2) > len(chain)


def test_hints_in_order():
    msgs, chat = "/v1/messages", "/v1/chat/completions"
    body = {"prompt_cache_key": "pck", "metadata": {"user_id": "u"}}
    assert session_key(msgs, {"X-Session-Affinity": "a"}, body) == session_key(chat, {"x_session_affinity": "a"}, None)
    assert session_key(msgs, {}, body) == session_key(chat, {}, {"prompt_cache_key": "pck"}) != session_key(
        msgs, {}, {"metadata": {"user_id": "pck2"}})
    assert session_key(msgs, {"session-id": "s"}, {"metadata": {"user_id": "u"}}) == session_key(
        msgs, {}, {"metadata": {"user_id": "u"}})
    assert session_key(chat, {"Session_Id": "s"}, {}) == session_key(chat, {"session-id": "s"}, None) is not None
    assert session_key(chat, {"x-request-id": "r"}, {"prompt_cache_key": ""}) is None
    assert session_key(chat, {}, {"metadata": {"user_id": "u"}}) is None  # OpenAI's metadata is not Anthropic's
    assert routing_hint(msgs, {}, b"not json") == (None, ())
    assert prefix_chain({"prompt": "x" * 253}) == () != prefix_chain({"prompt": "x" * 254})  # quoted: 256


def test_sessions_stick_and_spread():
    p = AffinityPolicy(seed=0)
    replicas = ["a", "b"]
    first = {s: p.choose(replicas, s, ()).replica for s in "wxyz"}
    assert sorted(first.values()) == ["a", "a", "b", "b"]  # new sessions balance: fewest sessions first
    for _ in range(3):
        assert {s: p.choose(replicas, s, ()).replica for s in "wxyz"} == first
    assert p.chosen["session"] == 12


def test_a_far_busier_replica_is_passed_over():
    p = AffinityPolicy(imbalance_abs=4, imbalance_rel=2.0, seed=0)
    home = p.choose(["a", "b"], "s", ()).replica
    other = "b" if home == "a" else "a"
    for _ in range(3):
        p.started(home)
    assert p.choose(["a", "b"], "s", ()).replica == home  # 3 more in flight: not far busier
    p.started(home)
    moved = p.choose(["a", "b"], "s", ())
    assert moved == type(moved)(other, "balance")
    assert p.choose(["a", "b"], "s", ()).replica == other  # the session stays where it moved
    for _ in range(4):
        p.finished(home)
    assert p.choose(["a", "b"], "s", ()).replica == other


def test_keyless_requests_follow_their_prefix():
    p = AffinityPolicy(seed=0)
    conv = [{"role": "user", "content": f"turn {i} " + "x" * 300} for i in range(8)]
    chains = [prefix_chain({"messages": conv[:i + 1]}) for i in range(8)]
    home = p.choose(["a", "b"], None, chains[0]).replica
    for chain in chains[1:]:
        c = p.choose(["a", "b"], None, chain)
        assert c.replica == home and c.why == "prefix"
    unrelated = prefix_chain({"messages": [{"role": "user", "content": "other " * 100}]})
    assert p.choose(["a", "b"], None, unrelated).why == "balance"


def test_a_replica_gone_forgets_its_sessions():
    p = AffinityPolicy(seed=0)
    home = p.choose(["a", "b"], "s", (1, 2, 3)).replica
    p.keep(["c"] if home == "a" else ["a", "c"])
    assert "s" not in p.sessions and home not in p.chunks
    assert p.choose(["c"], "s", (1, 2, 3)).replica == "c"
