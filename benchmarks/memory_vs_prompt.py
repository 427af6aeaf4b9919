"""Peak activation memory vs prompt length at a fixed chunk: ladle (chunked) vs one HF forward.

Both are measured with ladle.startup.memory.measure_peak: on CPU, torch.profiler records every allocation
and free, and the peak of their running sum above what existed before the call is exact.
- ladle: LLM.generate(prompt, max_tokens=1) with max_num_batched_tokens = --chunk. The KV pool is
  allocated at startup, before the measured call, so it is not counted: what is counted is the workspace
  of the steps (activations, attention tiles, logits, sampling) plus per-request bookkeeping.
- HF: model(ids, logits_to_keep=1) under inference_mode (SDPA attention), one pass over the whole prompt;
  it builds its own KV cache (DynamicCache), which is counted, as HF allocates it during the call. The KV
  share is also reported separately (2 x layers x kv_heads x head_dim x 4 B per token).

    python benchmarks/memory_vs_prompt.py --model-name qwen3-256 --chunk 2048
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.startup.memory import measure_peak  # noqa: E402

MiB = 2**20
CPU = torch.device("cpu")


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-name", default="qwen3-256")
    ap.add_argument("--chunk", type=int, default=2048, help="ladle's max_num_batched_tokens")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32767])
    ap.add_argument("--engines", default="ladle,hf")
    ap.add_argument("--out", default="memory_vs_prompt")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = build_model(args.model_name)
    facts = model_facts(model_dir)
    vocab, max_len = facts["vocab_size"], max(args.lengths) + 1
    kv_per_token = 2 * facts["num_hidden_layers"] * facts["num_key_value_heads"] * facts["head_dim"] * 4
    rows: list[dict[str, Any]] = []
    engines = args.engines.split(",")
    llm = hf = None
    if "ladle" in engines:
        blocks = -(-max_len // 16) + 16
        llm = LLM(model_dir, max_num_batched_tokens=args.chunk, max_model_len=max_len, num_kv_blocks=blocks,
                  enable_prefix_caching=False)
        act = llm.config.plan.inputs.activation
        llm.generate({"prompt_token_ids": prompt(64, vocab, -1)}, SamplingParams(max_tokens=1), use_tqdm=False)
    if "hf" in engines:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for n in args.lengths:
        ids = prompt(n, vocab, n)
        row: dict[str, Any] = {"prompt_tokens": n, "hf_kv_cache_mib": n * kv_per_token / MiB}
        if llm is not None:
            params = SamplingParams(temperature=0.0, max_tokens=1)
            start = time.perf_counter()
            peak = measure_peak(
                lambda ids=ids, params=params: llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False), CPU)
            row.update(ladle_peak_mib=peak / MiB, ladle_s=time.perf_counter() - start,
                       ladle_predicted_mib=act.predict_prefill(min(args.chunk, n), n) / MiB,
                       ladle_max_step_tokens=llm.stats.max_step_tokens)
        if hf is not None:
            x = torch.tensor([ids])

            def forward(x: torch.Tensor = x) -> None:
                with torch.inference_mode():
                    hf(x, logits_to_keep=1)

            start = time.perf_counter()
            row.update(hf_peak_mib=measure_peak(forward, CPU) / MiB, hf_s=time.perf_counter() - start)
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    def ratio(key: str, a: int, b: int) -> float | None:
        by = {r["prompt_tokens"]: r.get(key) for r in rows}
        return by[a] / by[b] if by.get(a) and by.get(b) else None

    top = max(args.lengths)
    save(args.out, {
        "benchmark": "memory_vs_prompt", "model": args.model_name, "model_config": facts, "chunk": args.chunk,
        "rows": rows, "ladle_top_over_2k": ratio("ladle_peak_mib", top, 2048),
        "hf_top_over_2k": ratio("hf_peak_mib", top, 2048), "goal_ladle_top_over_2k": 1.15,
    })


if __name__ == "__main__":
    main()
