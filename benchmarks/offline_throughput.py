"""Offline throughput, mixed lengths: ladle vs HF `generate` (padded static batches) vs HF continuous batching.

Every engine gets the same weights, the same random prompts and the same output lengths (greedy, EOS
ignored), in the same process, one after another in each repeat (the order rotates between repeats). The
ratio ladle / best HF is taken within each repeat; tables report medians over repeats.

- ladle: every prompt submitted at once to one engine, stepped to the end (what LLM.generate does).
- HF generate: static batches of --hf-batch-size requests in submission order, left-padded to the longest
  prompt of the batch, each run to the longest output of the batch (the extra tokens are computed, not
  counted). Each step's time is taken by a logits processor, so its TTFT / ITL are real too.
- HF generate_batch: transformers' continuous batching, with per-request max_new_tokens (its manager, as
  generate_batch drives it) and explicit num_blocks / page_size / max_batch_tokens, as needed on CPU.

    python benchmarks/offline_throughput.py --num-prompts 64 --input-len 64 1024 --output-len 32 256
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402

from ladle.entrypoints.bench import RequestTiming, Workload, random_workload, run_ladle_offline, summarize  # noqa: E402


def load_hf(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    from ladle.testing.hf_reference import use_torch_kernels

    use_torch_kernels()  # the peer runs on CPU: HF's PyTorch path, not fla's Triton kernels
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class StepClock:
    """A logits processor that only records when each generation step produced its tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_hf_generate(model: Any, workload: Workload, batch_size: int, pad_id: int) -> dict[str, Any]:
    from transformers import GenerationConfig, LogitsProcessorList

    start = time.perf_counter()
    timings: list[RequestTiming] = []
    for b in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[b : b + batch_size]
        outs = workload.output_lens[b : b + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = StepClock()
        cfg = GenerationConfig(do_sample=False, max_new_tokens=max(outs), min_new_tokens=max(outs),
                               eos_token_id=None, pad_token_id=pad_id)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                           logits_processor=LogitsProcessorList([clock]))
        for p, n in zip(prompts, outs):
            timings.append(RequestTiming(start, len(p), clock.times[:n], n))
    return summarize(timings, time.perf_counter() - start)


def run_hf_continuous(model: Any, workload: Workload, max_batch_tokens: int, page_size: int) -> dict[str, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    need = sum(-(-(len(p) + n) // page_size) for p, n in zip(workload.prompts, workload.output_lens))
    cb = ContinuousBatchingConfig(num_blocks=need + 8, page_size=page_size, max_batch_tokens=max_batch_tokens)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1)
    hints = WorkloadHints(max(len(p) for p in workload.prompts), max(workload.output_lens), len(workload.prompts))
    timings: dict[str, RequestTiming] = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=5, workload_hints=hints) as manager:
        for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens)):
            rid = manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True,
                                      eos_token_id=-1)
            timings[rid] = RequestTiming(start, len(p))
        done = 0
        while done < len(timings):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing")
                continue
            if result.is_finished():
                t = timings[result.request_id]
                t.token_times = list(result.timestamps or [])
                t.num_output_tokens = len(result.generated_tokens)
                t.error = result.error
                done += 1
    return summarize(list(timings.values()), time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-name", default="qwen3-512", help="a benchmarks/common.py MODELS entry")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="ladle's step budget, and HF continuous batching's max_batch_tokens")
    ap.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of HF generate")
    ap.add_argument("--page-size", type=int, default=256, help="HF continuous batching page size")
    ap.add_argument("--engines", default="ladle,hf_generate,hf_generate_batch")
    ap.add_argument("--out", default="offline_throughput", help="results/<out>.json")
    args = ap.parse_args()

    from ladle.frontend.llm_engine import LLMEngine

    model_dir = build_model(args.model_name)
    vocab = model_facts(model_dir)["vocab_size"]
    # A fresh workload per repeat (same for every engine in it), so ladle's prefix cache never hits a repeat.
    workloads = [random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab,
                                 args.seed + rep) for rep in range(args.repeats)]
    warm = random_workload(4, (args.input_len[0], min(args.input_len[1], 128)), (1, min(args.output_len[1], 8)),
                           vocab, seed=-1)
    engines = args.engines.split(",")
    runners: dict[str, Any] = {}
    max_len = args.input_len[1] + args.output_len[1]
    if "ladle" in engines:
        ladle = LLMEngine.from_kwargs(model=model_dir, max_num_batched_tokens=args.max_num_batched_tokens,
                                      max_model_len=max_len)
        runners["ladle"] = lambda w: run_ladle_offline(ladle, w)
    if "hf_generate" in engines:
        hf = load_hf(model_dir)
        pad = hf.generation_config.pad_token_id or 0
        runners["hf_generate"] = lambda w: run_hf_generate(hf, w, args.hf_batch_size, pad)
    if "hf_generate_batch" in engines:
        hf_cb = load_hf(model_dir)
        runners["hf_generate_batch"] = lambda w: run_hf_continuous(hf_cb, w, args.max_num_batched_tokens,
                                                                    args.page_size)
    for name, run in runners.items():
        run(warm)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for rep in range(args.repeats):
        order = list(runners)[rep % len(runners):] + list(runners)[: rep % len(runners)]
        for name in order:
            cpu = time.process_time()
            result = runners[name](workloads[rep])
            result["cpu_s"] = time.process_time() - cpu
            runs[name].append(result)
            print(f"repeat {rep} {name}: {result['output_tok_per_s']:.1f} output tok/s, "
                  f"{result['total_tok_per_s']:.1f} total tok/s, {result['duration_s']:.1f} s, "
                  f"failed {result['failed']}", flush=True)
    ratios: dict[str, list[float]] = {}
    if "ladle" in runs:
        for name in runs:
            if name != "ladle":
                ratios[f"ladle/{name}"] = [a["total_tok_per_s"] / b["total_tok_per_s"]
                                           for a, b in zip(runs["ladle"], runs[name])]
                ratios[f"ladle/{name} (CPU time)"] = [b["cpu_s"] / a["cpu_s"]
                                                      for a, b in zip(runs["ladle"], runs[name])]
        hf_names = [n for n in runs if n != "ladle"]
        if hf_names:
            ratios["ladle/best_hf"] = [a["total_tok_per_s"] / max(runs[n][i]["total_tok_per_s"] for n in hf_names)
                                       for i, a in enumerate(runs["ladle"])]
    median_run = {name: sorted(rs, key=lambda r: r["duration_s"])[len(rs) // 2] for name, rs in runs.items()}
    save(args.out, {
        "benchmark": "offline_throughput", "model": args.model_name, "model_config": model_facts(model_dir),
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "seeds": [args.seed + rep for rep in range(args.repeats)],
                     "prompt_tokens": [w.num_prompt_tokens for w in workloads],
                     "output_tokens": [w.num_output_tokens for w in workloads]},
        "settings": {"max_num_batched_tokens": args.max_num_batched_tokens, "ladle_max_model_len": max_len,
                     "hf_batch_size": args.hf_batch_size,
                     "page_size": args.page_size, "repeats": args.repeats},
        "runs": runs, "median_run": median_run,
        "ratios": {k: {"per_repeat": v, "median": statistics.median(v)} for k, v in ratios.items()},
    })


if __name__ == "__main__":
    main()
