"""The device run's prefix-reuse section on the stateful models: an agent's conversation (benchmarks/agent_turns.py's
workload, fewer turns) on a Qwen3.5 hybrid, whose hits resume from Gated DeltaNet state checkpoints, and on
DeepSeek-V4 (sliding window, compressed KV and compressor state), caching on and off, fp32. Per model: whether the
replies are the same both ways (`replies_identical`), the prompt tokens computed after the first turn with caching
over without (`computed_ratio`), and the median TTFT of those turns with caching over without (`ttft_ratio`)."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from agent_turns import MODELS, conversation
from agent_turns_worker import run_turns
from ladle.demo import build_checkpoint


def _turns(path: str, device: torch.device, caching: bool, system: list[int], tools: list[list[int]],
           reply: int) -> dict[str, Any]:
    from ladle import LLM, SamplingParams

    max_len = len(system) + sum(map(len, tools)) + reply * len(tools) + 64
    llm = LLM(path, device=str(device), dtype="float32", enable_prefix_caching=caching, max_model_len=max_len)

    def generate(ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        before = llm.stats.prompt_tokens
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True), use_tqdm=False)[0]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return list(out.outputs[0].token_ids), llm.stats.prompt_tokens - before

    try:
        generate(system[:64], 2)  # shapes warm before the first timed turn, on a prefix no turn shares
        return run_turns(generate, system, tools, reply)
    finally:
        llm.shutdown()


def prefix_checkpoint_check(device: torch.device, workdir: Path, small: bool) -> dict[str, Any]:
    turns, system_len, reply = (3, 300, 8) if small else (5, 4000, 32)
    out: dict[str, Any] = {}
    for name in ("qwen3_5", "deepseek_v4"):
        spec = dict(MODELS[name])
        path = build_checkpoint(workdir / f"prefix_{name}", spec.pop("arch"), vocab_size=4096, seed=0,
                                max_position_embeddings=32768, **spec)
        system, tools = conversation(turns, system_len, 4096, seed=0)
        if small:
            tools = [t[:100] for t in tools]
        runs = {caching: _turns(path, device, caching, system, tools, reply) for caching in (True, False)}
        on, off = runs[True]["rows"][1:], runs[False]["rows"][1:]
        out[name] = dict(replies_identical=runs[True]["replies"] == runs[False]["replies"],
                         new=[r["new"] for r in on], computed=[r["computed"] for r in on],
                         computed_ratio=round(sum(r["computed"] for r in on) / sum(r["computed"] for r in off), 3),
                         ttft_on_s=[round(r["ttft_s"], 4) for r in on], ttft_off_s=[round(r["ttft_s"], 4) for r in off],
                         ttft_ratio=round(statistics.median(a["ttft_s"] / b["ttft_s"] for a, b in zip(on, off)), 3))
        out[name]["ok"] = out[name]["replies_identical"] and out[name]["computed_ratio"] < 0.5
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["ok"] = all(r["ok"] for r in out.values())
    return out
