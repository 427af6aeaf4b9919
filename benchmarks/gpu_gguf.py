"""The device run's GGUF section: GGUF files on CUDA, where ladle has no block kernel yet and widens the file's
Q8_0 / Q4_0 / Q4_1 linears to the model dtype at load (the settings table says so). Tiny random Llama and Qwen2
files (ladle.testing.gguf_checkpoints, written here: the device machine has no network) are loaded on the device
and on the CPU (blocks kept, ladle's C kernels), fp32, prefill chunked: greedy tokens must be the same (`ok`). The
CPU path equals HF transformers' GGUF loader token for token in CI (tests/test_gguf.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PROMPTS = ["The quick brown fox jumps over the lazy dog, and the engine splits every long prompt into chunks.",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]


def _tokens(path: Path, device: str) -> tuple[list[list[int]], str]:
    from ladle import LLM, SamplingParams

    llm = LLM(str(path), device=device, dtype="float32", max_num_batched_tokens=16, max_prefill_length=7,
              max_model_len=256)
    try:
        prompts = [{"prompt_token_ids": llm.get_tokenizer()(p).input_ids} for p in PROMPTS]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], str(llm.config.settings["quantization"].value)
    finally:
        llm.shutdown()


def gguf_check(device: torch.device, workdir: Path, small: bool) -> dict[str, Any]:
    from ladle.testing.gguf_checkpoints import tiny_hf_model, write_gguf

    out: dict[str, Any] = {}
    for arch, qtype in (("llama", "Q4_1"), ("qwen2", "Q8_0"), ("llama", "Q4_0")):
        model, tok = tiny_hf_model(arch, seed=1)
        path = write_gguf(model, tok, workdir / f"gguf_{arch}_{qtype}" / f"tiny-{arch}.{qtype}.gguf", arch, qtype)
        here, quantization = _tokens(path, str(device))
        cpu, _ = _tokens(path, "cpu")
        out[f"{arch}_{qtype}"] = dict(tokens_identical=here == cpu, quantization=quantization, ok=here == cpu)
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out
