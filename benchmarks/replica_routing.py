"""Agent sessions replayed against two `ladle serve-replicas` replicas, with session routing and with Ray Serve's
default routing (issue 59, item 5).

S sessions share a system prompt of --prefix tokens; each turn resends the session's whole chat conversation (its
first user message, then every reply and a tool result of --tool tokens per turn) with its prompt_cache_key, and
streams a --reply token answer. C sessions are in flight at once, each waiting for its previous turn. Each
replica's KV pool holds the shared prefix and its share of the sessions' histories at their last turn (S / 2 with
--pool-share 0.5): what two replicas need when every session stays on one of them.

Per later turn (turn > 0): the prefix-cache hit rate, cached prompt tokens / prompt tokens
(usage.prompt_tokens_details.cached_tokens), against the most a cache could serve (the session's previous prompt:
its reply, re-tokenized from text, need not match the tokens it was decoded as); the same over the sessions' own
tokens (the prompt less the shared system prompt, which every replica soon holds whatever the routing); how many
turns went to another replica than their session's previous turn; and the TTFT. A tiny random Qwen3 (fp32, CPU),
greedy.

    python benchmarks/replica_routing.py --out benchmarks/results/replica_routing.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ladle.demo import build_checkpoint  # noqa: E402

MODEL = dict(arch="qwen3", vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, intermediate_size=512)
BLOCK = 16


def free_port() -> int:
    rng = random.Random(os.getpid())
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


class Text:
    """Words of the model's tokenizer, and how many tokens a text is (counted once, from the server)."""

    def __init__(self, model: str, seed: int) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model)
        self.rng = random.Random(seed)
        vocab = [w.strip("Ġ ") for w in self.tok.get_vocab()]
        self.words = sorted({w for w in vocab if w.isalpha() and 3 <= len(w) <= 8})

    def tokens(self, n: int) -> str:
        """A text of about n tokens."""
        out: list[str] = []
        while len(self.tok.encode(" ".join(out))) < n:
            out.extend(self.rng.choice(self.words) for _ in range(max(1, (n - len(out)) // 3)))
        return " ".join(out)


def start(model: str, routing: str, args: argparse.Namespace, blocks: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "ladle.entrypoints.cli", "serve-replicas", model, "--num-replicas",
                             "2", "--routing", routing, "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", str(args.max_model_len), "--num-kv-blocks", str(blocks),
                             "--max-num-seqs", str(args.concurrency)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
    base = f"http://127.0.0.1:{port}"
    pids: set[int] = set()
    deadline = time.monotonic() + 300
    with httpx.Client(base_url=base, timeout=10) as http:
        while len(pids) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError("\n".join(line for line in log.read_text().splitlines()
                                             if " INFO " not in line and "(raylet)" not in line)[-3000:])
            try:
                r = http.get("/health")
                if r.status_code == 200:
                    pids.add(r.json()["engine_pid"])
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
    return proc, base


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def workload(args: argparse.Namespace, text: Text) -> dict[str, Any]:
    """The sessions' texts, and the tokens of the system prompt alone and of the longest session's last turn (its
    replies stood in by text of --reply tokens)."""
    text.rng = random.Random(args.seed)
    w: dict[str, Any] = dict(system=text.tokens(args.prefix), firsts=[text.tokens(args.first) for _ in
                                                                       range(args.sessions)],
                             tools=[[text.tokens(args.tool) for _ in range(args.turns)] for _ in range(args.sessions)])

    def tokens(messages: list[dict[str, str]]) -> int:
        return len(text.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                return_dict=False))

    w["prefix_tokens"] = len(text.tok.apply_chat_template([{"role": "system", "content": w["system"]}],
                                                         tokenize=True, return_dict=False))
    longest = 0
    for s in range(args.sessions):
        messages = [{"role": "system", "content": w["system"]}, {"role": "user", "content": w["firsts"][s]}]
        for t in range(1, args.turns):
            messages += [{"role": "assistant", "content": text.tokens(args.reply)},
                         {"role": "user", "content": f"tool result {t}: {w['tools'][s][t]}"}]
        longest = max(longest, tokens(messages))
    w["last_turn_tokens"] = longest
    return w


async def replay(base: str, args: argparse.Namespace, w: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    system, firsts, tools = w["system"], w["firsts"], w["tools"]
    gate = asyncio.Semaphore(args.concurrency)
    rows: list[dict[str, Any]] = []

    async def session(http: httpx.AsyncClient, s: int) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": firsts[s]}]
        before = 0  # the previous turn's prompt tokens
        await asyncio.sleep(rng.random() * 0.2)
        for t in range(args.turns):
            if t:
                messages.append({"role": "user", "content": f"tool result {t}: {tools[s][t]}"})
            body = {"messages": messages, "max_tokens": args.reply, "ignore_eos": True, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "prompt_cache_key": f"session-{s}"}
            async with gate:
                t0 = time.perf_counter()
                ttft, reply, usage = None, "", None
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"{r.status_code}: {(await r.aread())[:500]!r}")
                    replica = r.headers.get("x-ladle-replica")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for c in chunk["choices"]:
                            if c["delta"].get("content"):
                                ttft = ttft if ttft is not None else time.perf_counter() - t0
                                reply += c["delta"]["content"]
            assert usage is not None
            prompt = usage["prompt_tokens"]
            rows.append(dict(session=s, turn=t, replica=replica, prompt=prompt,
                             cached=usage["prompt_tokens_details"]["cached_tokens"],
                             new=prompt - before, ttft_s=ttft if ttft is not None else time.perf_counter() - t0))
            before = prompt
            messages.append({"role": "assistant", "content": reply})

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await asyncio.gather(*(session(http, s) for s in range(args.sessions)))
    return rows


def summary(rows: list[dict[str, Any]], shared: int) -> dict[str, Any]:
    """shared: the system prompt's tokens, which every replica soon holds whatever the routing."""
    later = [r for r in rows if r["turn"] > 0]
    prompt = sum(r["prompt"] for r in later)
    own = sum(r["prompt"] - shared for r in later)
    by = {(r["session"], r["turn"]): r["replica"] for r in rows}
    moves = sum(by[(r["session"], r["turn"])] != by[(r["session"], r["turn"] - 1)] for r in later)
    ttft = sorted(r["ttft_s"] for r in later)
    return dict(later_turns=len(later), hit_rate=round(sum(r["cached"] for r in later) / prompt, 3),
                ideal_hit_rate=round(sum(r["prompt"] - r["new"] for r in later) / prompt, 3),
                own_hit_rate=round(sum(max(0, r["cached"] - shared) for r in later) / own, 3),
                own_ideal_hit_rate=round(sum(r["prompt"] - r["new"] - shared for r in later) / own, 3),
                hit_rate_per_turn=[round(sum(r["cached"] for r in rs) / sum(r["prompt"] for r in rs), 3)
                                   for t in sorted({r["turn"] for r in later})
                                   for rs in [[r for r in later if r["turn"] == t]]],
                replica_changes=moves, ttft_p50_ms=round(1e3 * statistics.median(ttft), 1),
                ttft_p99_ms=round(1e3 * ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))], 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4, help="sessions with a request in flight at once")
    ap.add_argument("--prefix", type=int, default=2048, help="system prompt tokens every session shares")
    ap.add_argument("--first", type=int, default=64, help="a session's first user message")
    ap.add_argument("--tool", type=int, default=96, help="tokens of tool result a turn appends")
    ap.add_argument("--reply", type=int, default=16, help="tokens a turn decodes")
    ap.add_argument("--pool-share", type=float, default=0.5,
                    help="each replica's KV pool holds this share of the sessions' last-turn histories")
    ap.add_argument("--routing", nargs="+", default=["session", "ray"], choices=["session", "ray"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each routing, each on fresh replicas")
    ap.add_argument("--out", help="write the rows and the summaries here (JSON)")
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(tmp + "/model", **MODEL)
        w = workload(args, Text(model, args.seed))
        own = w["last_turn_tokens"] + args.reply - w["prefix_tokens"]  # a session's own tokens at its last turn
        args.max_model_len = w["last_turn_tokens"] + args.reply + 8 * BLOCK
        blocks = (-(-w["prefix_tokens"] // BLOCK) + max(1, round(args.sessions * args.pool_share)) * -(-own // BLOCK)
                  + 2 * args.concurrency)
        for routing in args.routing:
            repeats = []
            for i in range(args.repeats):  # a fresh pair of replicas each time; the sessions' arrival jitter varies
                proc, base = start(model, routing, args, blocks, Path(tmp) / f"{routing}{i}.log")
                try:
                    t0 = time.perf_counter()
                    rows = asyncio.run(replay(base, args, w, args.seed + i))
                    wall = time.perf_counter() - t0
                finally:
                    stop(proc)
                repeats.append(dict(summary=summary(rows, w["prefix_tokens"]) | {"wall_s": round(wall, 1)},
                                    rows=rows))
                print(routing, json.dumps(repeats[-1]["summary"]), flush=True)
            runs[routing] = dict(repeats=repeats, **{
                f"{k}_mean": round(statistics.mean(r["summary"][k] for r in repeats), 3)
                for k in ("hit_rate", "own_hit_rate", "ideal_hit_rate", "own_ideal_hit_rate", "replica_changes")})
            print(routing, {k: v for k, v in runs[routing].items() if k != "repeats"}, flush=True)
    result = dict(
        command="python benchmarks/replica_routing.py " + " ".join(sys.argv[1:]),
        cpu=next((line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")),
            platform.processor()),
        workload={k: getattr(args, k) for k in ("sessions", "turns", "concurrency", "prefix", "first", "tool",
                                                 "reply", "pool_share")}
        | {"num_kv_blocks_per_replica": blocks, "block_size": BLOCK, "prefix_tokens": w["prefix_tokens"],
           "last_turn_tokens": w["last_turn_tokens"]},
        runs=runs)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
