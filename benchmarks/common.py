"""Shared by the benchmark scripts: the benchmark checkpoints, machine facts, JSON results.

Checkpoints are Qwen3 with random weights (speed does not depend on their values), built once into a cache
directory. The tokenizer is the demo BPE (about 11,900 learned tokens) padded with plain added tokens
`<tN>` up to the model's vocab, so every id the model can emit decodes to text, as with a real vocab.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(os.environ.get("LADLE_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")

MODELS: dict[str, dict[str, Any]] = {
    # The throughput / latency model: 41.6M parameters, real work on 2 CPU cores.
    "qwen3-512": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, intermediate_size=1536, max_position_embeddings=32768),
    # Narrow, for the 32K-token measurements (memory, stalls) that must finish in minutes on 2 cores.
    "qwen3-256": dict(vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, intermediate_size=768, max_position_embeddings=32768),
    # qwen3-512 with Qwen's real vocabulary size (151,936): the structured-output bitmask and the head at scale.
    # Its tokenizer grows the BPE itself to 151,936 entries (extend_bpe), so grammars see an ordinary vocabulary.
    "qwen3-512-152k": dict(bpe_vocab=True, vocab_size=151936, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=64, intermediate_size=1536, max_position_embeddings=32768),
    # About 100M parameters: the vLLM side-by-side model.
    "qwen3-768": dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, head_dim=64, intermediate_size=2048, max_position_embeddings=32768),
    # qwen3-768 with room for 64K-token prompts and their decodes (the long-context side-by-side).
    "qwen3-768-128k": dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           num_key_value_heads=4, head_dim=64, intermediate_size=2048, max_position_embeddings=131072),
    # qwen3-256 (the demo model's shape) with room for a 100K-token prompt.
    "qwen3-256-128k": dict(vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=32, intermediate_size=768, max_position_embeddings=131072),
    # Qwen3-MoE with qwen3-512's attention and as many active MLP weights per token (4 of 16 experts of 384).
    "qwen3-moe-512": dict(arch="qwen3_moe", vocab_size=32000, hidden_size=512, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=1536,
                          moe_intermediate_size=384, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                          max_position_embeddings=32768),
    # Qwen3.5 with qwen3-512's width: 6 Gated DeltaNet layers and 2 gated full-attention layers (every 4th).
    "qwen3.5-512": dict(arch="qwen3_5", vocab_size=32000, hidden_size=512, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=1536,
                        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                        linear_value_head_dim=64, tie_word_embeddings=False, max_position_embeddings=32768),
    # DeepSeek-V4 at qwen3-512's width: CSA, HCA and sliding layers (rates 4 and 128, window 128), 16 experts of
    # 384 with 4 active (the first layer hash-routed), 4 hyper-connection streams.
    "dsv4-512": dict(arch="deepseek_v4", vocab_size=32000, hidden_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=1, head_dim=128, intermediate_size=384,
                     q_lora_rank=256, n_routed_experts=16, num_experts_per_tok=4, o_groups=4, o_lora_rank=128,
                     index_n_heads=8, index_head_dim=64, index_topk=64, sliding_window=128, hc_mult=4,
                     layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                                  "sliding_attention", "compressed_sparse_attention"],
                     mlp_layer_types=["hash_moe", "moe", "moe", "moe"], tie_word_embeddings=False,
                     max_position_embeddings=32768),
    # qwen3-768's size as Mistral with a 16-token window: its next token depends on the last 12 x 16 = 192
    # tokens alone, so after a repeated span of its own greedy text longer than that it continues that text (the
    # speculative-decoding benchmark's copying model).
    "mistral-768-w16": dict(arch="mistral", vocab_size=32000, hidden_size=768, num_hidden_layers=12,
                            num_attention_heads=12, num_key_value_heads=4, head_dim=64, intermediate_size=2048,
                            sliding_window=16, tie_word_embeddings=True, max_position_embeddings=32768),
    # For debugging the scripts.
    "tiny": dict(vocab_size=12000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=32768),
}


def cache_dir() -> Path:
    base = os.environ.get("LADLE_BENCH_CACHE") or Path(tempfile.gettempdir()) / "ladle-bench-models"
    return Path(base)


def build_model(name: str) -> str:
    """The checkpoint directory of MODELS[name], built on first use (a few seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from ladle.demo import build_checkpoint, fill_hash_tables

    out = cache_dir() / name
    if (out / "done").exists():
        return str(out)
    spec = dict(MODELS[name])
    vocab = spec.pop("vocab_size")
    bpe_vocab = spec.pop("bpe_vocab", False)
    build_checkpoint(out, spec.pop("arch", "qwen3"), vocab_size=min(vocab, 11000), seed=0, **spec)
    if bpe_vocab:
        extend_bpe(out / "tokenizer.json", vocab)
    tok = AutoTokenizer.from_pretrained(out)
    if vocab > len(tok):
        tok.add_tokens([f"<t{i}>" for i in range(len(tok), vocab)])
        tok.save_pretrained(out)
    config = AutoConfig.from_pretrained(out)
    if config.vocab_size != vocab:
        config.vocab_size = vocab
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            fill_hash_tables(model)
        model.generation_config = GenerationConfig.from_pretrained(out)
        model.save_pretrained(out, safe_serialization=True)
    (out / "done").write_text("ok\n")
    return str(out)


def extend_bpe(path: Path, vocab: int, max_chars: int = 16) -> None:
    """Grow a byte-level BPE tokenizer.json to `vocab` ids with merges of two tokens it has (deterministic): new
    ordinary vocabulary entries, as a real 150K vocabulary has, where padding with added tokens would give a
    tokenizer no real model has (and one that llguidance takes minutes to read)."""
    import random

    data = json.loads(path.read_text())
    model = data["model"]
    ids, merges = model["vocab"], model["merges"]
    taken = set(ids) | {t["content"] for t in data["added_tokens"]}
    next_id = max([*ids.values(), *(t["id"] for t in data["added_tokens"])]) + 1
    tokens = sorted(ids, key=ids.get)
    rng = random.Random(0)
    while next_id < vocab:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if a + b in taken or len(a + b) > max_chars:
            continue
        merges.append([a, b])
        ids[a + b] = next_id
        taken.add(a + b)
        tokens.append(a + b)
        next_id += 1
    path.write_text(json.dumps(data, ensure_ascii=False))


def set_budget(core: Any, budget: int) -> None:
    """The same EngineCore with a smaller step budget and chunk cap. The scheduler reads both from its config
    on every step; callers check the core's counters (largest step, chunk count) to prove it applied."""
    core.config = dataclasses.replace(core.config, max_num_batched_tokens=budget, max_prefill_length=budget)
    core.scheduler.config = core.config


def model_facts(model_dir: str) -> dict[str, Any]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    keys = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "num_local_experts",
            "num_experts_per_tok", "max_position_embeddings", "layer_types", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "n_routed_experts",
            "compress_rates", "sliding_window", "index_topk", "hc_mult", "q_lora_rank")
    return {k: cfg[k] for k in keys if cfg.get(k) is not None}


def cpu_name() -> str:
    """The CPU's model name and its instruction-set level (ladle.kernels.cpu_isa), as every figure must name them."""
    from ladle.kernels.cpu_isa import cpu_flags, detect, evidence

    model = platform.processor()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = cpu_flags()
    level = detect(flags)
    return f"{model} ({level.label}; {evidence(level, flags)}), {os.cpu_count()} cores"


def machine() -> dict[str, Any]:
    import torch
    import transformers

    return {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "transformers": transformers.__version__,
            "python": platform.python_version(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "load_average_1_5_15": os.getloadavg()}


def command() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def save(name: str, result: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    result = {"command": command(), "machine": machine(), **result}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def per_call_ms(fn: Callable[[], object], seconds: float = 0.03) -> float:
    """fn's mean time in ms over as many calls as fit in `seconds`, after one call to warm it up."""
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n * 1000


def write_markdown(lines: list[str], out: str | None) -> None:
    """A markdown result, written to `out` when given (each row was printed as it was measured)."""
    text = "\n".join(lines) + "\n"
    if out:
        Path(out).write_text(text)
        print(f"wrote {out}")
