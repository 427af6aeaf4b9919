"""A Claude Code session against `ladle serve`, request by request: prompt tokens, tokens served from the prefix
cache, tokens computed, and time to first token; then a second session, which should read its system prompt and
tools from the cache.

The released client (tests/agent_clients/install.py pins it) runs as a user runs it, with the README's "Coding
agents" setup, in a loopback-only network namespace with the server. A random-weight model never chooses a tool, so
the test suite's forcing proxy (tests/agent_clients/forcing_proxy.py) forces Claude Code's own Read tool on a script
of files: tool_choice names Read, and the path is written into the answer's tool_use block in place of the one the
model wrote (the request's tools stay as Claude Code sent them, so the prompt is the client's own). Claude Code runs
each read and sends the file back on its next request, as in a real session. The files are Python sources of the
standard library (the same text every run). The session:

  1. `claude -p "Read a.py, b.py and c.py ..."`: three forced reads, then the model's answer;
  2. `claude -p --continue "Now read d.py ..."`: the history resent after a new prompt, one forced read, the answer;
  3. a second session, `claude -p "say hi"`.

Each row is one request as the proxy saw it: usage from the answer's own events (prompt = input_tokens +
cache_read_input_tokens; computed = input_tokens), TTFT from the request to its first event (ladle sends
message_start with the first token). Each prompt is rendered here as the server renders it (ladle's conversion and
the checkpoint's template; its length checked against the server's count): "new" is how much of it the session's
previous request did not share (its length less their longest common prefix), "grown" its length less the previous
one's; computed / new is what the issue bounds (<= 1.2). They differ where the template renders history anew:
Qwen3.5's drops the reasoning of the turns before the last user message, so the turn after a new prompt re-renders
the history from the first assistant message that reasoned, on any engine. The second session's cache reads are set
against its system + tools prefix (count_tokens of its system and tools with a one-word user message: a little over
the prefix).

The models are tiny random-weight checkpoints in their family's chat format (ladle.testing.tool_checkpoints) made to
end their replies after a few tokens (tests/agent_clients/quiet_model.py), with a 4,096-token byte-level BPE
(Claude Code's first request is ~28K tokens of it; ~21K on a real Qwen tokenizer): Qwen3 (attention only) and
Qwen3.5 (Gated DeltaNet + attention: a prefix hit resumes from a state checkpoint at a message end), fp32, CPU.

    python benchmarks/agent_session.py --out benchmarks/results/agent_session.json   # needs root (the namespace)
"""
from __future__ import annotations

import argparse
import difflib
import fnmatch
import inspect
import json
import shlex
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
from agent_clients import clients  # noqa: E402
from agent_clients.cache_reads import cached_and_computed, is_conversation, system_and_tools_tokens  # noqa: E402
from agent_clients.forcing_proxy import Force, ForcingProxy, Seen  # noqa: E402
from agent_clients.install import PINS, install  # noqa: E402
from agent_clients.netns import loopback_only, only_loopback_reachable  # noqa: E402
from agent_clients.quiet_model import make_quiet  # noqa: E402
from common import cpu_name  # noqa: E402
from ladle.entrypoints.openai.anthropic.protocol import MessagesRequest  # noqa: E402
from ladle.entrypoints.openai.anthropic.serving import to_chat  # noqa: E402
from ladle.entrypoints.openai.chat.render import chat_prompt, render  # noqa: E402
from ladle.testing.tool_checkpoints import build_tool_checkpoint  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

MAX_MODEL_LEN = 131072
TURN_TIMEOUT = 1800  # seconds for one `claude -p`, its requests included (a cold ~20K-token prefill on 2 cores)
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512, vocab_size=4096, max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=False)
MODELS: dict[str, dict[str, Any]] = {
    "qwen3": dict(family="qwen3", quiet={"likely": ('"',)}),  # a forced call's JSON strings end soon
    # Qwen3.5's template opens a thinking block itself, and its calls hold raw text that only "\n</parameter>" ends
    # (text never holds '<' there, so a likely '<' after a likely newline closes it).
    "qwen3_5": dict(family="qwen3_5", arch="qwen3_5", quiet={"likely": ("</think>", "Ċ", "</", "<")},
                    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64),
}


def source_files(work: Path) -> dict[str, Path]:
    """Four standard-library sources of different lengths, as a.py .. d.py: what the forced reads return."""
    out = {}
    for name, module, chars in zip("abcd", (fnmatch, shlex, textwrap, difflib), (1500, 6000, 3000, 9000)):
        out[name] = work / f"{name}.py"
        out[name].write_text(inspect.getsource(module)[:chars])
    return out


def build(work: Path, name: str) -> Path:
    spec = dict(MODELS[name])
    family, quiet = spec.pop("family"), spec.pop("quiet")
    model = Path(build_tool_checkpoint(work / name, family, seed=2, **SHAPE, **spec))
    make_quiet(model, **quiet)
    return model


def claude_turn(exe: Path, home: Path, work: Path, upstream: str, prompt: str, forces: tuple[Force, ...],
                resume: bool = False) -> tuple[list[Seen], dict[str, Any]]:
    proxy = ForcingProxy(upstream, forces)
    url = proxy.start()
    try:
        run = clients.claude(exe, home, work, url, prompt, TURN_TIMEOUT, resume=resume)
    finally:
        proxy.stop()
    bad = [(s.path, s.status) for s in proxy.seen if s.status != 200]
    if run.returncode != 0 or bad or sum(s.forced for s in proxy.seen) != len(forces):
        raise RuntimeError(f"claude -p {prompt!r}: exit {run.returncode}, answers {bad}, forced "
                           f"{sum(s.forced for s in proxy.seen)}/{len(forces)}\n{run.stdout[-3000:]}\n"
                           f"{run.stderr[-3000:]}")
    return proxy.seen, json.loads(run.stdout)


def prompt_ids(model: Path) -> Callable[[dict[str, Any]], list[int]]:
    """A Messages request's prompt token ids as the server renders them (ladle's own conversion and chat template)."""
    tokenizer = AutoTokenizer.from_pretrained(model)

    def ids(body: dict[str, Any]) -> list[int]:
        req = MessagesRequest.model_validate(body)
        chat, _ = to_chat(req, list(req.messages), req.max_tokens, False)
        return render(tokenizer, chat_prompt(chat, tokenizer.chat_template), False)[0]
    return ids


def shared(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def rows(step: str, seen: list[Seen], ids_of: Callable[[dict[str, Any]], list[int]],
         previous: list[int] | None) -> tuple[list[dict[str, Any]], list[int] | None]:
    """One row per Messages request; previous: the prompt ids of the session's last conversation request."""
    out = []
    for s in seen:
        if s.path.split("?")[0] != "/v1/messages":
            continue
        cached, computed = cached_and_computed(s)
        prompt = cached + computed
        main = is_conversation(s)
        ids = ids_of(s.body)
        if len(ids) != prompt:
            raise RuntimeError(f"the benchmark renders {len(ids)} prompt tokens where the server counted {prompt}")
        new = len(ids) - shared(ids, previous) if main and previous is not None else None
        grown = len(ids) - len(previous) if main and previous is not None else None
        out.append({"step": step, "main": main, "forced": s.forced, "messages": len(s.body.get("messages") or []),
                    "prompt": prompt, "cached": cached, "computed": computed, "new": new, "grown": grown,
                    "computed_over_new": round(computed / new, 3) if new else None,
                    "ttft_s": round(s.first_event_s, 3) if s.first_event_s is not None else None,
                    "output": int(s.usage.get("output_tokens", 0))})
        if main:
            previous = ids
    return out, previous


def session(exe: Path, model: Path, tmp: Path) -> dict[str, Any]:
    tmp.mkdir()
    srv = ServerProcess(str(model), tmp, "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name",
                        clients.MODEL).start(timeout=600)
    try:
        work, home = tmp / "work", tmp / "home"
        work.mkdir()
        files = source_files(work)
        read = {k: Force("Read", {"file_path": str(p)}, in_answer=True) for k, p in files.items()}
        table: list[dict[str, Any]] = []
        seen, first = claude_turn(exe, home, work, srv.base_url,
                                  "Read a.py, b.py and c.py, then say what they have in common.",
                                  (read["a"], read["b"], read["c"]))
        ids_of = prompt_ids(model)
        part, last = rows("1: three reads", seen, ids_of, None)
        table += part
        seen, _ = claude_turn(exe, home, work, srv.base_url, "Now read d.py and compare it with them.",
                              (read["d"],), resume=True)
        part, last = rows("2: --continue, one read", seen, ids_of, last)
        table += part
        seen2, second = claude_turn(exe, home, work, srv.base_url, "say hi", ())
        part, _ = rows("3: second session", seen2, ids_of, None)
        table += part
        main2 = next(s for s in seen2 if is_conversation(s))
        prefix = system_and_tools_tokens(srv.base_url, main2.body)
        return {"rows": table, "second_session": {
            "system_tools_prefix_tokens": prefix,
            "cache_read_input_tokens": cached_and_computed(main2)[0],
            "client_json_usage": second.get("usage"),
            "read_share": round(cached_and_computed(main2)[0] / prefix, 4)},
            "first_session_client_usage": first.get("usage")}
    finally:
        srv.stop()


def markdown(results: dict[str, Any]) -> str:
    lines = [f"Claude Code {results['client']} against ladle serve; CPU: {results['cpu']}.", ""]
    for name, r in results["models"].items():
        s2 = r["second_session"]
        lines += [f"### {name}", "",
                  "| step | request | messages | prompt | grown | new | cached | computed | computed/new | TTFT s |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for i, row in enumerate(r["rows"]):
            kind = ("forced Read" if row["forced"] else "answer") if row["main"] else "side request (no tools)"
            blank = {k: "" if row[k] is None else f"{row[k]:,}" for k in ("grown", "new")}
            lines.append(f"| {row['step']} | {i}: {kind} | {row['messages']} | {row['prompt']:,} | {blank['grown']} | "
                         f"{blank['new']} | {row['cached']:,} | {row['computed']:,} | "
                         f"{'' if row['computed_over_new'] is None else row['computed_over_new']} | {row['ttft_s']} |")
        lines += ["", f"Second session: {s2['cache_read_input_tokens']:,} of its {s2['system_tools_prefix_tokens']:,}-"
                      f"token system + tools prefix read from the cache ({s2['read_share']:.1%}); Claude Code's JSON "
                      f"usage: {json.dumps(s2['client_json_usage'])}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    exe = install()["claude"]  # before the namespace: it reaches the npm registry
    results: dict[str, Any] = {"client": PINS["claude"][1], "cpu": cpu_name(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp, loopback_only():
        assert only_loopback_reachable()
        for name in args.models.split(","):
            model = build(Path(tmp), name)
            results["models"][name] = session(exe, model, Path(tmp) / f"{name}_run")
            print(textwrap.indent(markdown({**results, "models": {name: results["models"][name]}}), "  "),
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
        args.out.with_suffix(".md").write_text(markdown(results) + "\n")


if __name__ == "__main__":
    main()
