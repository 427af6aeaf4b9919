"""One engine, one process: start it on a checkpoint, time `generate` over a token-id workload, print a JSON
line (startup seconds, generate seconds, output token ids). Run by benchmarks/vllm_side_by_side.py under
ladle's interpreter or under vLLM's own virtual environment; vLLM needs the `__main__` guard (it spawns).

    python benchmarks/peer_worker.py --engine ladle --model DIR --dtype float32 --workload W.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def start(engine: str, model: str, dtype: str, max_model_len: int) -> tuple[Any, Any, Any]:
    """(llm, SamplingParams, a function from token ids to the engine's prompt)."""
    if engine == "ladle":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from ladle import LLM, SamplingParams

        return LLM(model, dtype=dtype, max_model_len=max_model_len), SamplingParams, (
            lambda ids: {"prompt_token_ids": ids})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB; vLLM's CPU default leaves too little here
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    return LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=0), SamplingParams, (
        lambda ids: TokensPrompt(prompt_token_ids=ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("ladle", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workload", required=True, help="JSON: {prompts: [[ids]], output_lens: [n]}")
    args = ap.parse_args()
    work = json.loads(Path(args.workload).read_text())
    max_len = max(len(p) + n for p, n in zip(work["prompts"], work["output_lens"])) + 16
    t0 = time.perf_counter()
    llm, params_cls, prompt = start(args.engine, args.model, args.dtype, max_len)
    startup = time.perf_counter() - t0
    params = [params_cls(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work["output_lens"]]
    prompts = [prompt(p) for p in work["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generate = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps({"engine": args.engine, "dtype": args.dtype, "startup_s": round(startup, 2),
                                  "generate_s": round(generate, 3), "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
