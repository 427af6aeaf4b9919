"""The hostile corpus against `ladle serve`: schema, regex and grammar bombs through every API that compiles a
client's constraint, forced tool calls with nested models, tool histories that lie, all while agent-style
requests run beside them and /health is polled. It reports each case's status and time, the 5xx (none may come
from client input), hangs, the slowest /health, and whether the API process and the engine survived.

    python benchmarks/hostile_corpus.py --out benchmarks/results/hostile_corpus.md

The model is a tiny hermes-format Qwen3 (ladle.testing.tool_checkpoints): tool parsing and the reasoning parser
derived from its architecture, as the agents meet them.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_name  # noqa: E402
from server_abuse import health_gaps  # noqa: E402

TIMEOUT_S = 120.0  # a case not answered by then is a hang


def _required(n: int) -> dict:
    return {"type": "object", "required": [f"r{i:06d}" for i in range(n)]}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


SCHEMAS: dict[str, Any] = {
    "required x10,000": _required(10_000),
    "required x30,000": _required(30_000),
    "required x100,000": _required(100_000),
    "nested 60 deep": _nested(60),
    "nested 500 deep": _nested(500),
    "enum x100,000": {"enum": [f"e{i}" for i in range(100_000)]},
    "anyOf x20,000": {"anyOf": [{"const": f"c{i}"} for i in range(20_000)]},
    "properties x5,000": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5_000)}},
    "unsupported keyword": {"type": "array", "uniqueItems": True},
    "$defs and $ref": {"$defs": {"A": {"type": "integer"}}, "type": "object",
                       "properties": {"x": {"$ref": "#/$defs/A"}}, "required": ["x"]},
}


def schema_cases(model: str) -> list[tuple[str, str, dict]]:
    user = [{"role": "user", "content": "x"}]
    cases = []
    for name, schema in SCHEMAS.items():
        cases += [
            (f"{name} / response_format", "/v1/chat/completions", {"model": model, "messages": user, "max_tokens": 8,
             "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
            (f"{name} / tool parameters", "/v1/chat/completions", {"model": model, "messages": user, "max_tokens": 8,
             "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}),
            (f"{name} / text.format", "/v1/responses", {"model": model, "input": "x", "max_output_tokens": 8,
             "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
            (f"{name} / input_schema", "/v1/messages", {"model": model, "messages": user, "max_tokens": 8,
             "tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": schema}]}),
        ]
    crash_in_grammar = json.dumps(_required(30_000))
    for name, so in [
        ("choice x100,000", {"choice": [f"c{i:06d}" for i in range(100_000)]}),
        ("choice x4,000", {"choice": [f"c{i:06d}" for i in range(4_000)]}),
        ("regex 2 MB", {"regex": "a" * (2 << 20)}),
        ("regex (a*)*b", {"regex": "(a*)*b"}),
        ("regex unclosed", {"regex": "("}),
        ("regex matching nothing", {"regex": "[^\\x00-\\x{10FFFF}]"}),
        ("lark with a %json crash inside", {"grammar": f"start: %json {crash_in_grammar}"}),
        ("lark unknown rule", {"grammar": "start: nothing_here"}),
    ]:
        cases.append((f"{name} / structured_outputs", "/v1/completions",
                      {"model": model, "prompt": "x", "max_tokens": 8, "structured_outputs": so}))
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    cases += [
        ("tool result, unknown id / chat", "/v1/chat/completions", {"model": model, "max_tokens": 8, "tools": tools,
         "messages": [*user, call, {"role": "tool", "tool_call_id": "call_2", "content": "r"}]}),
        ("tool result before its call / chat", "/v1/chat/completions", {"model": model, "max_tokens": 8,
         "tools": tools, "messages": [*user, {"role": "tool", "tool_call_id": "call_1", "content": "r"}, call]}),
        ("function_call_output, unknown id / responses", "/v1/responses", {"model": model, "max_output_tokens": 8,
         "input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c9",
                                                       "output": "r"}]}),
        ("tool_result, unknown id / messages", "/v1/messages", {"model": model, "max_tokens": 8, "messages": [
            *user, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "r"}]}]}),
    ]
    return cases


def agent_turn(model: str, i: int) -> tuple[str, str, dict]:
    """An agent's ordinary request, run beside the corpus: a long shared system prompt, tools, a question."""
    system = "You are a coding agent. " * 100
    tools = [{"type": "function", "function": {"name": f"tool{k}", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}}, "required": ["path"]}}} for k in range(8)]
    return (f"agent turn {i}", "/v1/chat/completions", {"model": model, "max_tokens": 16, "tools": tools,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"task {i}"}]})


def post(base: str, case: tuple[str, str, dict]) -> dict[str, Any]:
    name, path, body = case
    start = time.perf_counter()
    try:
        r = httpx.post(base + path, json=body, timeout=TIMEOUT_S)
        status: int | str = r.status_code
        text = r.text
    except httpx.TimeoutException:
        status, text = "hang", ""
    except httpx.HTTPError as e:
        status, text = type(e).__name__, ""
    message = ""
    if isinstance(status, int) and status >= 400:
        try:
            err = json.loads(text).get("error", {})
            message = err.get("message", "") if isinstance(err, dict) else str(err)
        except ValueError:
            message = text[:200]
    return {"case": name, "status": status, "seconds": round(time.perf_counter() - start, 3),
            "message": message[:160]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the markdown section (a .json beside it keeps every row)")
    args = ap.parse_args()
    from ladle.testing.tool_checkpoints import build_tool_checkpoint

    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    model = build_tool_checkpoint(work / "qwen3_tools", "qwen3", seed=2)
    log = open(work / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "ladle.entrypoints.openai.api_server", "--model", model,
                             "--host", "127.0.0.1", "--port", "0", "--max-model-len", "4096"],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    base = ""
    deadline = time.monotonic() + 180
    while not base and time.monotonic() < deadline:
        m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", (work / "server.log").read_text())
        base = f"http://127.0.0.1:{m.group(1)}" if m else ""
        time.sleep(0.1)
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    name = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    before = httpx.get(base + "/health", timeout=10).json()
    stop, gaps = threading.Event(), [0.0]
    poller = threading.Thread(target=health_gaps, args=(base, stop, gaps), daemon=True)
    poller.start()
    corpus = schema_cases(name)
    agents = [agent_turn(name, i) for i in range(12)]
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(6) as pool:  # the corpus and the agents' turns interleaved, six at a time
        mixed = [c for pair in zip(corpus, agents + [None] * len(corpus)) for c in pair if c is not None]
        rows = list(pool.map(lambda c: post(base, c), mixed))
    took = time.perf_counter() - start
    stop.set()
    poller.join()
    after = httpx.get(base + "/health", timeout=10).json()
    proc.terminate()
    code = proc.wait(60)
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    fives = [r for r in rows if isinstance(r["status"], int) and r["status"] >= 500]
    hangs = [r for r in rows if not isinstance(r["status"], int)]
    summary = {"cpu": cpu_name(), "cases": len(rows), "corpus_cases": len(corpus), "agent_turns": len(agents),
               "statuses": statuses, "num_5xx": len(fives), "num_hangs_or_errors": len(hangs),
               "worst_health_s": round(max(gaps), 3), "seconds": round(took, 1),
               "api_restarts": after["api_restarts"], "engine_restarts": after["engine_restarts"],
               "engine_pid_unchanged": after["engine_pid"] == before["engine_pid"], "exit_code": code}
    Path(args.out).with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    lines = ["## Hostile corpus", "",
             f"`python benchmarks/hostile_corpus.py --out {args.out}` on {summary['cpu']} (2 cores): "
             f"{len(corpus)} hostile cases and {len(agents)} agent turns, six at a time, against one `ladle serve` "
             "of a tiny hermes-format Qwen3, /health polled throughout.", "",
             f"- Statuses: {', '.join(f'{k} x{v}' for k, v in sorted(statuses.items()))}; **5xx: {len(fives)}**, "
             f"hangs or dropped connections: {len(hangs)}; slowest /health: **{max(gaps):.3f} s**.",
             f"- After it all: API process restarts {after['api_restarts']}, engine restarts "
             f"{after['engine_restarts']}, engine process unchanged: {summary['engine_pid_unchanged']}; SIGTERM "
             f"then drained and exited {code}.", "",
             "| case | status | s | what the client was told |", "|---|---|---|---|"]
    for r in rows:
        if not r["case"].startswith("agent turn"):
            told = " ".join(r["message"].split()).replace("|", "/")
            lines.append(f"| {r['case']} | {r['status']} | {r['seconds']} | {told} |")
    agent_rows = [r for r in rows if r["case"].startswith("agent turn")]
    lines.append(f"| agent turns x{len(agent_rows)} | {'/'.join(sorted({str(r['status']) for r in agent_rows}))} | "
                 f"{max(r['seconds'] for r in agent_rows)} (slowest) | |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))


if __name__ == "__main__":
    main()
