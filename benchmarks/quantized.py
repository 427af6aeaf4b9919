"""The release weight formats against unquantized weights on one ~100M-parameter model, in one run: resident
weight bytes, batch-1 decode tokens/s and a 1K-token prefill, for fp32, bf16 and FP8 (block-scaled e4m3 with
fp32 scales, the rest bf16 as the releases keep it; and the same with fp32 activations). And on a ~100M MoE
model (qwen3-moe-512), fp32 and bf16 against FP8 and against FP8 with MXFP4 experts (DeepSeek-V4's expert
format), all but the fp32 one with bf16 activations.

Every variant is loaded once and measured in turns (interleaved, so drift on a shared machine hits all), and
each number is the median of the turns. Prefix caching is off, so each prefill computes all its tokens.

    python benchmarks/quantized.py                 # qwen3-768, 3 turns
    python benchmarks/quantized.py --model-name tiny --repeats 1   # quick
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, cache_dir, model_facts, save  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.testing.fp8_checkpoints import write_fp8_checkpoint  # noqa: E402

# variant -> (checkpoint: "full", "fp8", or the MoE model's "moe", "moe-fp8", "moe-mxfp4"; model dtype)
VARIANTS = {"fp32": ("full", "float32"), "bf16": ("full", "bfloat16"), "fp8": ("fp8", "bfloat16"),
            "fp8 (fp32 activations)": ("fp8", "float32"), "moe fp32": ("moe", "float32"), "moe bf16": ("moe", "bfloat16"),
            "moe fp8": ("moe-fp8", "bfloat16"), "moe fp8 + mxfp4 experts": ("moe-mxfp4", "bfloat16")}


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.core.model_executor.runner.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def decode_tok_s(llm: LLM, vocab: int, rng: random.Random, new: int) -> float:
    """Batch-1 decode: (new - 1) tokens over the time beyond the first token's."""
    prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(16)]}
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    return (new - 1) / (time.perf_counter() - start - first)


def prefill_s(llm: LLM, vocab: int, rng: random.Random, tokens: int) -> float:
    prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(tokens)]}
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-name", default="qwen3-768")
    ap.add_argument("--moe-model-name", default="qwen3-moe-512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=65)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--out", default="quantized")
    args = ap.parse_args()
    full, moe = build_model(args.model_name), build_model(args.moe_model_name)
    paths = {"full": full, "moe": moe}
    for key, src, name, experts in (("fp8", full, args.model_name, "fp8"), ("moe-fp8", moe, args.moe_model_name, "fp8"),
                                    ("moe-mxfp4", moe, args.moe_model_name, "fp4")):
        out = cache_dir() / f"{name}-{'fp8' if experts == 'fp8' else 'fp8-mxfp4'}"
        if not (out / "config.json").exists():
            write_fp8_checkpoint(src, out, expert_dtype=experts)
        paths[key] = str(out)
    vocab = min(model_facts(full)["vocab_size"], model_facts(moe)["vocab_size"])
    llms = {name: LLM(paths[ckpt], dtype=dtype, enable_prefix_caching=False, max_model_len=4096,
                      max_num_batched_tokens=args.prefill_tokens) for name, (ckpt, dtype) in VARIANTS.items()}
    runs: dict[str, dict[str, list[float]]] = {name: {"decode": [], "prefill": []} for name in VARIANTS}
    rng = random.Random(0)
    for name, llm in llms.items():  # warm up: the first steps of a process pay one-time costs
        decode_tok_s(llm, vocab, rng, 4)
    for turn in range(args.repeats):
        for name, llm in llms.items():
            runs[name]["decode"].append(decode_tok_s(llm, vocab, rng, args.decode_tokens))
            runs[name]["prefill"].append(prefill_s(llm, vocab, rng, args.prefill_tokens))
            print(f"turn {turn} {name:24} decode {runs[name]['decode'][-1]:6.1f} tok/s  prefill "
                  f"{runs[name]['prefill'][-1]:6.2f} s", flush=True)
    rows = []
    for name, llm in llms.items():
        rows.append({"variant": name, "weight_bytes": weight_bytes(llm),
                     "weights": llm.engine.core.config.settings["quantization"].value,
                     "decode_tok_s": statistics.median(runs[name]["decode"]),
                     "prefill_s": statistics.median(runs[name]["prefill"]), "turns": runs[name]})
    by = {r["variant"]: r for r in rows}
    ratios = {"fp8_decode_over_bf16": by["fp8"]["decode_tok_s"] / by["bf16"]["decode_tok_s"],
              "fp8_decode_over_fp32": by["fp8"]["decode_tok_s"] / by["fp32"]["decode_tok_s"],
              "fp8_prefill_over_bf16": by["fp8"]["prefill_s"] / by["bf16"]["prefill_s"],
              "moe_fp8_decode_over_bf16": by["moe fp8"]["decode_tok_s"] / by["moe bf16"]["decode_tok_s"],
              "moe_mxfp4_decode_over_bf16": by["moe fp8 + mxfp4 experts"]["decode_tok_s"] / by["moe bf16"]["decode_tok_s"],
              "moe_mxfp4_decode_over_fp32": by["moe fp8 + mxfp4 experts"]["decode_tok_s"] / by["moe fp32"]["decode_tok_s"],
              "moe_mxfp4_prefill_over_bf16": by["moe fp8 + mxfp4 experts"]["prefill_s"] / by["moe bf16"]["prefill_s"]}
    print(ratios)
    save(args.out, {"benchmark": "quantized", "model": args.model_name, "model_config": model_facts(full),
                    "moe_model": args.moe_model_name, "moe_model_config": model_facts(moe),
                    "decode_tokens": args.decode_tokens, "prefill_tokens": args.prefill_tokens,
                    "repeats": args.repeats, "rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
