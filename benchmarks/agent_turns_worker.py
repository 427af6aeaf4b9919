"""One engine, one model, caching on or off, in a process of its own: run benchmarks/agent_turns.py's conversation
turn by turn and print a JSON line of rows (prompt, new, computed tokens, TTFT) and the replies. Run under
ladle's interpreter or under vLLM's own virtual environment (vLLM needs the `__main__` guard: it spawns).

    python benchmarks/agent_turns_worker.py --engine ladle --model DIR --caching on --workload W.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable


def ladle_engine(model: str, caching: bool, max_len: int) -> Callable[[list[int], int], tuple[list[int], int]]:
    """A function (prompt ids, max tokens) -> (output ids, prompt tokens computed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ladle import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=caching, max_model_len=max_len)

    def generate(ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        before = llm.stats.prompt_tokens
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True), use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), llm.stats.prompt_tokens - before

    return generate


def vllm_engine(model: str, caching: bool, max_len: int) -> Callable[[list[int], int], tuple[list[int], int]]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB; vLLM's CPU default leaves too little here
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", max_model_len=max_len, enable_prefix_caching=caching, seed=0)

    def generate(ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        out = llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                             ignore_eos=True), use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), len(ids) - (out.num_cached_tokens or 0)

    return generate


def run_turns(generate: Callable[[list[int], int], tuple[list[int], int]], system: list[int],
              tools: list[list[int]], reply_tokens: int) -> dict[str, Any]:
    """Each turn: the first token alone (TTFT, tokens computed), then the reply, which hits all but the tail."""
    context, rows, replies = list(system), [], []
    for turn, tool in enumerate(tools):
        new = len(context) - (rows[-1]["prompt"] if rows else 0) + len(tool)
        context += tool
        start = time.perf_counter()
        _, computed = generate(context, 1)
        ttft = time.perf_counter() - start
        reply, _ = generate(context, reply_tokens)
        rows.append(dict(turn=turn, prompt=len(context), new=new, computed=computed, ttft_s=ttft))
        replies.append(reply)
        context += reply
    return {"rows": rows, "replies": replies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("ladle", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--caching", choices=("on", "off"), required=True)
    ap.add_argument("--workload", required=True, help="JSON: {system: [ids], tools: [[ids]], reply: n}")
    args = ap.parse_args()
    work = json.loads(Path(args.workload).read_text())
    max_len = len(work["system"]) + sum(map(len, work["tools"])) + work["reply"] * len(work["tools"]) + 64
    engine = ladle_engine if args.engine == "ladle" else vllm_engine
    generate = engine(args.model, args.caching == "on", max(max_len, 32768))
    print("RESULT " + json.dumps(run_turns(generate, work["system"], work["tools"], work["reply"])), flush=True)


if __name__ == "__main__":
    main()
