"""bfloat16 greedy tokens, ladle against HF transformers, and whether each divergence is rounding.

Both run the same random checkpoint in bf16 on the same token-id prompts (greedy, ignore_eos). Where a request's
tokens first differ, the shared prefix is scored three ways at that position: HF in float32 (the reference),
HF in bf16, and ladle in bf16 (its logprobs). A divergence is rounding when the float32 margin between the two
engines' picks is no larger than HF bf16's own logit error at that position (its largest |bf16 - float32| over
the vocabulary): at bf16 precision HF's own ranking of two tokens that close is noise.

    python benchmarks/bf16_agreement.py --model-name qwen3-256 --num-prompts 16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402

from ladle.entrypoints.bench import random_workload  # noqa: E402
from ladle.testing.hf_reference import first_divergence, hf_greedy, rounding_tie  # noqa: E402


def last_logits(model: Any, ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from ladle import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-name", default="qwen3-256")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 48])
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-prefill-length", type=int, default=None)
    ap.add_argument("--out", default="bf16_agreement")
    args = ap.parse_args()
    model_dir = build_model(args.model_name)
    work = random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                           model_facts(model_dir)["vocab_size"], seed=0)
    chunking = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                  ("max_prefill_length", args.max_prefill_length)) if v is not None}
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=max(args.input_len) + max(args.output_len) + 16,
              **chunking)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in work.output_lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
    hf = {dt: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval() for dt in (torch.bfloat16,
                                                                                            torch.float32)}
    rows = []
    for i, (prompt, n, out) in enumerate(zip(work.prompts, work.output_lens, outs)):
        ours, theirs = list(out.outputs[0].token_ids), hf_greedy(hf[torch.bfloat16], prompt, n)
        j = first_divergence(ours, theirs)
        row: dict[str, Any] = {"request": i, "prompt_len": len(prompt), "output_len": n, "first_divergence": j}
        if j is not None:
            a, b = ours[j], theirs[j]
            ref, hf16 = (last_logits(hf[dt], prompt + ours[:j]) for dt in (torch.float32, torch.bfloat16))
            step = out.outputs[0].logprobs[j]
            row.update(ladle_token=a, hf_token=b, **rounding_tie(ref, hf16, a, b),
                       ladle_bf16_margin=step[a].logprob - step[b].logprob if b in step else None)
        rows.append(row)
        print(row, flush=True)
    diverged = [r for r in rows if r["first_divergence"] is not None]
    summary = {"identical": len(rows) - len(diverged), "diverged": len(diverged),
               "diverged_by_rounding": sum(r["rounding"] for r in diverged),
               "ladle_agrees_with_float32_at_divergence": sum(r["reference_argmax"] == r["ladle_token"]
                                                             for r in diverged)}
    print(summary)
    save(args.out, {"benchmark": "bf16_agreement", "model": args.model_name, "model_config": model_facts(model_dir),
                    "input_len": args.input_len, "output_len": args.output_len, "ladle_settings": chunking,
                    "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
