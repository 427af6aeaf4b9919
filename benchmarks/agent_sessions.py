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

One-off requests with no session (a title, a subagent, a batch job: --one-offs per session turn, of
--one-off-tokens each) can pass between the turns; the pool then also has room for the ones in flight. A setting
ending in "+hints" sends each session's requests with its session id, so the prefix cache keeps the sessions'
prefixes ahead of the one-offs' (ladle.kv_cache.session_retention); without it eviction is plain LRU.

    python benchmarks/agent_sessions.py --kv-offloading-size off 64MiB --out benchmarks/results/agent_sessions.json
    python benchmarks/agent_sessions.py --sessions 6 --turns 4 --prefix 320 --tool 40   # the issue's shape
    python benchmarks/agent_sessions.py --pool-sessions 1 --one-offs 2 --one-off-tokens 1024 \
        --kv-offloading-size off off+hints                                             # retention
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, build_model  # noqa: E402

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


def engine_for(model: str, args: argparse.Namespace, tier: str, disk: str | None) -> LLM:
    """An engine with tier's host tier ("off": none; "SIZE": that much host memory; "+disk": with a disk tier in
    `disk`; "+hints" changes only what replay sends)."""
    # A session's last turn (the restart's extra turn included), less the shared prefix.
    own = args.first + args.turns * (args.reply + args.tool) + args.reply
    final = max(args.prefix + own, args.one_off_tokens + args.reply)
    # The shared prefix once, and --pool-sessions of the sessions' own tokens at their last turn (plus a block or two
    # per request in flight for its partial tail, and room for the one-offs in flight).
    blocks = (-(-args.prefix // BLOCK) + max(1, round(args.sessions * args.pool_sessions)) * -(-own // BLOCK)
              + 2 * args.concurrency)
    if args.one_offs:
        blocks += args.concurrency * -(-(args.one_off_tokens + args.reply) // BLOCK)
    size, *flags = tier.split("+")
    return LLM(model, max_model_len=final + BLOCK, num_kv_blocks=blocks, max_num_seqs=args.concurrency,
               kv_offloading_size=0 if size == "off" else size,
               kv_disk_cache_dir=disk if "disk" in flags else None)


def replay(llm: LLM, args: argparse.Namespace, turns: range, hints: bool = False) -> list[dict[str, Any]]:
    """Every request of the replay's `turns`, in the order they finished (the sessions' histories are drawn from
    args.seed, so a later range continues an earlier replay's sessions, on any engine); hints: send each session's
    id with its requests. One-off requests have session -1."""
    rng = random.Random(args.seed)
    vocab = args.vocab
    prefix = [rng.randrange(vocab) for _ in range(args.prefix)]
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.reply, ignore_eos=True)
    history = {s: prefix + [rng.randrange(vocab) for _ in range(args.first)] for s in range(args.sessions)}
    sent: dict[int, list[int]] = {}  # each session's previous prompt + reply
    # Turns before the range: the histories only, as the replies of a greedy run are the same on every engine.
    replies = getattr(args, "replies", {})

    def tool(session: int, turn: int) -> list[int]:  # drawn per turn: the same whatever order turns finish in
        draw = random.Random(f"{args.seed}:{session}:{turn}")
        return [draw.randrange(vocab) for _ in range(args.tool)]

    for t in range(turns.start):
        for s in range(args.sessions):
            sent[s] = history[s] + replies[(s, t)]
            history[s] = sent[s] + tool(s, t)
    queue = [(s, t) for t in turns for s in range(args.sessions)]  # sessions take turns in order
    if args.one_offs:  # after each session turn, its one-offs (numbered in the whole replay: the same on any engine)
        queue = [item for s, t in queue for item in
                 [(s, t)] + [(-1, (t * args.sessions + s) * args.one_offs + k) for k in range(args.one_offs)]]
    flight: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []

    def submit() -> None:
        while queue and len(flight) < args.concurrency:
            session, turn = queue[0]
            if session >= 0 and any(f["session"] == session for f in flight.values()):
                return  # its previous turn is still running: the agent waits for it
            queue.pop(0)
            if session < 0:
                draw = random.Random(f"{args.seed}:once:{turn}")
                ids = [draw.randrange(vocab) for _ in range(args.one_off_tokens)]
                rid = f"once{turn}"
                flight[rid] = dict(session=session, turn=turn, prompt=len(ids), new=len(ids),
                                   start=time.perf_counter())
                engine.add_request(rid, None, ids, params)
                continue
            ids = history[session]
            rid = f"s{session}t{turn}"
            new = len(ids) - common_prefix(ids, sent.get(session, []))
            flight[rid] = dict(session=session, turn=turn, prompt=len(ids), new=new, start=time.perf_counter())
            engine.add_request(rid, None, ids, params, session_id=f"session-{session}" if hints else None)

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
                if session < 0:
                    rows.append(dict(session=session, reply=reply, **{k: v for k, v in f.items() if k != "start"}))
                    continue
                replies[(session, f["turn"])] = reply
                sent[session] = history[session] + reply
                history[session] = sent[session] + tool(session, f["turn"])
                rows.append(dict(session=session, reply=reply, **{k: v for k, v in f.items() if k != "start"}))
        submit()
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The sessions' later turns (one-offs left out)."""
    rows = [r for r in rows if r["session"] >= 0]
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
    ap.add_argument("--pool-sessions", type=float, default=0.25,
                    help="the fraction of the sessions' own tokens (at their last turn) the KV pool holds")
    ap.add_argument("--one-offs", type=int, default=0, help="one-off requests (no session) after each session turn")
    ap.add_argument("--one-off-tokens", type=int, default=1024, help="a one-off request's prompt tokens")
    ap.add_argument("--kv-offloading-size", nargs="+", default=["off"],
                    help="host tiers to compare: 'off', a size (e.g. 64MiB), or a size with a disk tier (64MiB+disk), "
                         "each in its own engine; '+hints' sends the session ids (off+hints, 64MiB+hints)")
    ap.add_argument("--model", default="tiny", choices=["tiny", *MODELS],
                    help="tiny (4 layers x 256, the default) or a benchmarks/common.py shape, e.g. qwen3-768")
    ap.add_argument("--out", help="write the rows and the summary here (JSON)")
    args = ap.parse_args()
    args.vocab = (MODEL if args.model == "tiny" else MODELS[args.model])["vocab_size"]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(Path(tmp) / "model", **MODEL) if args.model == "tiny" else build_model(args.model)
        for tier in args.kv_offloading_size:
            args.replies = {}
            disk = str(Path(tmp) / f"kv-{len(runs)}")
            hints = "hints" in tier.split("+")[1:]
            with engine_for(model, args, tier, disk) as llm:
                rows = replay(llm, args, range(args.turns), hints)
            runs[tier] = dict(summary=summary(rows), rows=rows)
            # A restart (a new engine, as after kill -9 or an upgrade): every session's next turn.
            with engine_for(model, args, tier, disk) as llm:
                after = replay(llm, args, range(args.turns, args.turns + 1), hints)
            turns = [r for r in after if r["session"] >= 0]
            runs[tier]["after_restart"] = dict(
                computed_tokens_median=statistics.median(r["computed"] for r in turns),
                prompt_tokens_median=statistics.median(r["prompt"] for r in turns),
                ttft_p50_ms=round(1e3 * percentile([r["ttft_s"] for r in turns], 0.5), 1), rows=after)
            print(tier, json.dumps(runs[tier]["summary"]), "after restart:",
                  json.dumps({k: v for k, v in runs[tier]["after_restart"].items() if k != "rows"}), flush=True)
    tokens = {tier: [r.get("reply") for r in run["rows"] + run["after_restart"]["rows"]] for tier, run in runs.items()}
    result = dict(
        command="python benchmarks/agent_sessions.py " + " ".join(sys.argv[1:]),
        cpu=next((line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")),
            platform.processor()),
        workload={k: getattr(args, k) for k in ("model", "sessions", "turns", "concurrency", "prefix", "first",
                                                 "tool", "reply", "pool_sessions", "one_offs", "one_off_tokens")},
        same_tokens=len({json.dumps(t) for t in tokens.values()}) == 1, runs=runs)
    print("replies equal across tiers:", result["same_tokens"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
