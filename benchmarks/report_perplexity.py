"""The report section of benchmarks/perplexity.py: SmolLM2's perplexity in each weight format beside HF's."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from report_common import table


def perplexity_lines(r: dict[str, Any]) -> list[str]:
    texts, rows, m = r["texts"], r["rows"], r["machine"]
    names = [t["name"] for t in texts]
    lines = ["## SmolLM2: perplexity of each weight format", "",
             f"Reproduce: `{r['command']}`", "",
             f"Model: {r['model']}. The oracle is HF transformers' `gguf_file=` load, every tensor widened to fp32; "
             "ladle runs the file kept quantized (fp32 and bf16 compute) and an FP8 checkpoint (e4m3, an fp32 scale "
             f"per {r['fp8_block'][0]}x{r['fp8_block'][1]} block, written by `ladle.testing.fp8_checkpoints` from the "
             "oracle's widened weights; the tied embedding and head stay fp32; not the releases' 128x128 blocks: "
             "ladle stacks q/k/v into one FP8 linear whose parts must start on the block grid, and SmolLM2's q_proj "
             "has 576 rows). Every engine scores the same token ids (the oracle's tokenizer) in "
             f"the same non-overlapping windows of at most {r['window']} tokens, each from its start: perplexity = "
             "exp(mean negative log-likelihood of tokens 2..N of each window). ladle scores through "
             f"`SamplingParams(prompt_logprobs=0)`, each window prefilled in chunks of "
             f"{r['settings']['max_num_batched_tokens']} tokens with the KV carried over "
             f"(max_model_len {r['settings']['max_model_len']}). CPU: {r['cpu']}; torch {m['torch']}, "
             f"transformers {m['transformers']}, {m['threads']} thread(s), a shared machine.", ""]
    lines += table(["text", "file (the standard library's)", "sha256", "tokens in file", "tokens scored (windows)"],
                   [[t["name"], f"`{Path(t['file']).name}`, Python {m['python']}", f"`{t['sha256']}`",
                     t["file_tokens"],
                     f"{t['tokens']} ({', '.join(str(w) for w in t['windows'])})"] for t in texts])
    lines.append("")
    head = ["engine"]
    for n in names:
        head += [f"{n}: perplexity", "/ HF", "max abs token logprob diff"]
    body = []
    for row in rows:
        cells: list[Any] = [row["engine"]]
        for n in names:
            e = row["texts"][n]
            diff = e.get("max_abs_token_logprob_diff")
            cells += [f"{e['perplexity']:.4f}", f"{e['ratio_to_hf']:.6f}", "—" if diff is None else f"{diff:.2g}"]
        body.append(cells)
    lines += table(head, body)
    lines.append("")
    gguf = rows[1]
    worst = max(abs(gguf["texts"][n]["ratio_to_hf"] - 1) for n in names)
    lines.append(f"- **Goal: ladle's GGUF perplexity within {r['goal']:.1%} of HF's on the same text: worst "
                 f"{worst:.1e} relative ({worst:.5%}), {'met' if worst <= r['goal'] else 'missed'}.**")
    lines.append("- The max abs token logprob diff is the largest difference from HF's log-probability of any one "
                 "scored token: fp32 through other kernels for the GGUF row; bf16 compute and FP8 weights move single "
                 "tokens by far more than they move the mean.")
    return lines + [""]
