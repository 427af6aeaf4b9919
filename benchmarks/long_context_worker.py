"""One engine, one process, for benchmarks/long_context.py: start ladle or vLLM on a checkpoint with a chunk size,
then time each measurement asked for, one after another: the TTFT of a cold prompt of L tokens (one token
generated), or decode tokens/s of one request at a context of L tokens: the same prompt again with n new
tokens, its prefix served by the prefix cache (every full block of it), so the run is n tokens of decode after
a prefill of less than a block. (Subtracting a TTFT from a cold run instead left a few seconds of decode inside
a prefill that varies by more than that.) Prints one JSON line per measurement (with the process's peak resident memory so far) and runs under
ladle's interpreter or vLLM's own virtual environment (vLLM needs the `__main__` guard).

    python benchmarks/long_context_worker.py --engine ladle --model DIR --chunk 2048 --max-len 70000 ttft:8192
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start(engine: str, model: str, chunk: int, max_len: int) -> tuple[Any, Any, Any]:
    if engine == "ladle":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from ladle import LLM, SamplingParams

        llm = LLM(model, dtype="float32", max_model_len=max_len, max_num_batched_tokens=chunk,
                  max_prefill_length=chunk, enable_prefix_caching=True)
        return llm, SamplingParams, lambda ids: {"prompt_token_ids": ids}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "8")  # GiB: a 64K-token context and room to spare
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", max_model_len=max_len, seed=0, max_num_batched_tokens=chunk,
              enable_chunked_prefill=True, enable_prefix_caching=True)
    return llm, SamplingParams, lambda ids: TokensPrompt(prompt_token_ids=ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("ladle", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--max-len", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("measurements", nargs="+", help="ttft:L or decode:L:n")
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm, params_cls, prompt = start(args.engine, args.model, args.chunk, args.max_len)
    print("RESULT " + json.dumps({"kind": "startup", "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
    rng = random.Random(args.seed)
    for spec in args.measurements:
        kind, length, *rest = spec.split(":")
        ids = [rng.randrange(args.vocab) for _ in range(int(length))]  # fresh tokens: nothing cached
        new = int(rest[0]) if rest else 1
        t = time.perf_counter()
        llm.generate([prompt(ids)], params_cls(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        ttft = time.perf_counter() - t
        result: dict[str, Any] = {"kind": kind, "tokens": int(length), "ttft_s": round(ttft, 3)}
        if kind == "decode":
            t = time.perf_counter()
            llm.generate([prompt(ids)], params_cls(temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False)
            result |= {"new_tokens": new, "decode_tok_s": round(new / (time.perf_counter() - t), 2)}
        print("RESULT " + json.dumps(result | {"peak_rss_mib": round(peak_rss_mib())}), flush=True)


if __name__ == "__main__":
    main()
