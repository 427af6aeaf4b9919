"""Agent sessions replayed against a device pool that holds a quarter of them (issue 59's workload).

S sessions share a system + tools prefix; each turn resends the session's whole conversation with the model's
last reply and a new tool result appended, and decodes a short reply. C sessions are in flight at once and the
sessions take turns in order, so by the time a session comes back the others have filled the pool. Per request:
prompt tokens, new tokens (the prompt less its longest common prefix with the session's previous prompt and
reply), tokens computed (prompt less the prefix cache's hit) and TTFT (from add_request to the step that
returned the first token). The KV pool holds the shared prefix once and a quarter of the sessions' own tokens at
their last turn.

Tiers off, the prefix cache lives only in that pool and a returning session recomputes its history; with
--kv-offloading-size the pool's evicted blocks wait in the host tier and come back on a hit. Each tier setting
runs in its own engine on the same workload; greedy, a tiny random Qwen3 (fp32, CPU).

    python benchmarks/agent_sessions.py --kv-offloading-size off 64MiB --out benchmarks/results/agent_sessions.json
    python benchmarks/agent_sessions.py --sessions 6 --turns 4 --prefix 320 --tool 40   # the issue's shape
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ladle import LLM, SamplingParams  # noqa: E402
from ladle.demo import build_checkpoint  # noqa: E402

MODEL = dict(arch="qwen3", vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, intermediate_size=512)
BLOCK = 16


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def replay(model: str, args: argparse.Namespace, tier: str) -> list[dict[str, Any]]:
    """Every request of the replay, in the order they finished; tier: kv_offloading_size, or "off"."""
    rng = random.Random(args.seed)
    vocab = MODEL["vocab_size"]
    prefix = [rng.randrange(vocab) for _ in range(args.prefix)]
    # A session's last turn, less the shared prefix.
    own = args.first + (args.turns - 1) * (args.reply + args.tool) + args.reply
    final = args.prefix + own
    # The shared prefix once, and a quarter of the sessions' own tokens at their last turn (plus a block or two
    # per request in flight for its partial tail).
    blocks = -(-args.prefix // BLOCK) + max(1, args.sessions // 4) * -(-own // BLOCK) + 2 * args.concurrency
    llm = LLM(model, max_model_len=final + BLOCK, num_kv_blocks=blocks, max_num_seqs=args.concurrency,
              kv_offloading_size=None if tier == "off" else tier)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.reply, ignore_eos=True)
    history = {s: prefix + [rng.randrange(vocab) for _ in range(args.first)] for s in range(args.sessions)}
    sent: dict[int, list[int]] = {}  # each session's previous prompt + reply
    queue = [(s, t) for t in range(args.turns) for s in range(args.sessions)]  # sessions take turns in order
    flight: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []

    def submit() -> None:
        while queue and len(flight) < args.concurrency:
            session, turn = queue[0]
            if any(f["session"] == session for f in flight.values()):
                return  # its previous turn is still running: the agent waits for it
            queue.pop(0)
            ids = history[session]
            rid = f"s{session}t{turn}"
            new = len(ids) - common_prefix(ids, sent.get(session, []))
            flight[rid] = dict(session=session, turn=turn, prompt=len(ids), new=new, start=time.perf_counter())
            engine.add_request(rid, None, ids, params)

    submit()
    while flight:
        for out in engine.step():
            f = flight[out.request_id]
            if "ttft_s" not in f and out.outputs and out.outputs[0].token_ids:
                f["ttft_s"] = time.perf_counter() - f["start"]
                f["computed"] = f["prompt"] - out.num_cached_tokens
            if out.finished:
                del flight[out.request_id]
                session = f.pop("session")
                reply = list(out.outputs[0].token_ids)
                sent[session] = history[session] + reply
                history[session] = sent[session] + [rng.randrange(vocab) for _ in range(args.tool)]
                rows.append(dict(session=session, reply=reply, **{k: v for k, v in f.items() if k != "start"}))
        submit()
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 0]
    return dict(
        later_turns=len(later),
        new_tokens_median=statistics.median(r["new"] for r in later),
        computed_tokens_median=statistics.median(r["computed"] for r in later),
        computed_over_new_median=round(statistics.median(r["computed"] / r["new"] for r in later), 2),
        ttft_p50_ms=round(1e3 * percentile([r["ttft_s"] for r in later], 0.5), 1),
        ttft_p99_ms=round(1e3 * percentile([r["ttft_s"] for r in later], 0.99), 1),
        per_turn=[dict(turn=t, prompt=statistics.median(r["prompt"] for r in rs),
                       new=statistics.median(r["new"] for r in rs),
                       computed=statistics.median(r["computed"] for r in rs),
                       ttft_p50_ms=round(1e3 * percentile([r["ttft_s"] for r in rs], 0.5), 1))
                  for t in sorted({r["turn"] for r in rows}) for rs in [[r for r in rows if r["turn"] == t]]],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=2, help="sessions with a request in flight at once")
    ap.add_argument("--prefix", type=int, default=1024, help="system + tools tokens every session shares")
    ap.add_argument("--first", type=int, default=64, help="a session's first user message")
    ap.add_argument("--tool", type=int, default=96, help="tokens of tool result a turn appends")
    ap.add_argument("--reply", type=int, default=16, help="tokens a turn decodes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-offloading-size", nargs="+", default=["off"],
                    help="host tiers to compare: 'off' or a size (e.g. 64MiB), each in its own engine")
    ap.add_argument("--out", help="write the rows and the summary here (JSON)")
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(tmp, **MODEL)
        for tier in args.kv_offloading_size:
            rows = replay(model, args, tier)
            runs[tier] = dict(summary=summary(rows), rows=rows)
            print(tier, json.dumps(runs[tier]["summary"]), flush=True)
    tokens = {tier: [r.get("reply") for r in run["rows"]] for tier, run in runs.items()}
    result = dict(
        command="python benchmarks/agent_sessions.py " + " ".join(sys.argv[1:]),
        cpu=next((line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")),
            platform.processor()),
        workload={k: getattr(args, k) for k in ("sessions", "turns", "concurrency", "prefix", "first", "tool",
                                                 "reply")},
        same_tokens=len({json.dumps(t) for t in tokens.values()}) == 1, runs=runs)
    print("replies equal across tiers:", result["same_tokens"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
