"""The device script's tensor-parallel section (benchmarks/gpu_h200.py): on a machine with 2 or more GPUs,
greedy tokens at each tensor_parallel_size equal TP 1 on a small real-weight checkpoint, then offline
throughput at each size on a dummy-weight shape (random weights are drawn per shard, so only speed is compared
there). With one GPU it records why it did not run. --dry-run runs it on CPU with gloo."""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def _greedy(path: str, tp: int, device: str, prompts: list[list[int]]) -> list[list[int]]:
    from ladle import LLM, SamplingParams

    with LLM(path, device=device, dtype="float32", tensor_parallel_size=tp, max_model_len=1024) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _throughput(path: str, tp: int, device: str, requests: int, prompt_len: int, new: int) -> dict[str, Any]:
    from ladle import LLM, SamplingParams

    start = time.perf_counter()
    with LLM(path, device=device, load_format="dummy", tensor_parallel_size=tp, max_model_len=4096) as llm:
        startup = time.perf_counter() - start
        rng = random.Random(0)
        vocab = llm.engine.core.hf_config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)]} for _ in range(requests)]
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
        seconds = time.perf_counter() - start
        executor = llm.engine.core.model_executor
        sends = getattr(executor, "broadcasts", 0)
    return {"startup_s": round(startup, 1), "generate_s": round(seconds, 2),
            "output_tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / seconds, 1),
            "broadcast_ms_per_step": round(1000 * executor.broadcast_s / sends, 3) if sends else None}


def tensor_parallel(device: torch.device, workdir: Path, config: Any, small: bool) -> dict[str, Any]:
    """config: the HF config of the throughput shape (weights are drawn at load)."""
    from ladle.demo import build_checkpoint

    count = torch.cuda.device_count() if device.type == "cuda" else 2
    if count < 2:
        return {"skipped": f"{count} GPU on this machine; tensor parallelism needs 2 or more"}
    sizes = [n for n in (2, 4, 8) if n <= count]
    name = "cuda" if device.type == "cuda" else "cpu"
    tiny = build_checkpoint(workdir / "tp-tiny", "qwen3", **TINY, seed=0)
    rng = random.Random(1)
    prompts = [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in (5, 40, 200, 700)]
    base = _greedy(tiny, 1, name, prompts)
    out: dict[str, Any] = {"gpus": count, "greedy_identical_to_tp1": {
        tp: _greedy(tiny, tp, name, prompts) == base for tp in sizes}}
    path = workdir / "tp-shape"
    config.save_pretrained(path)
    requests, plen, new = (4, 32, 8) if small else (64, 1000, 200)
    out["throughput"] = {tp: _throughput(str(path), tp, name, requests, plen, new) for tp in [1, *sizes]}
    return out
