"""`ladle plan --load-format dummy` on a DeepSeek-V4-Flash-shaped config (the second seed report's model) with
the memory budget of that report's box, in fp32 on this CPU.

The attention is Flash's own: 64 heads x 512 head dim over one shared K=V head, q LoRA 1024, 8 output groups
of rank 1024, a 64 x 128 Lightning Indexer keeping 512 entries, window 128, compression rates 4 and 128,
YaRN compress rope. The rest is cut so that the dummy weights and the profile fit this machine: hidden 1024,
2 layers (one CSA, one HCA), 8 experts of 512.

The seed's box had 3.4 GiB of headroom after its weights and KV cache, in bf16. fp32 doubles every byte, so
the budget here is weights + KV pool + state slots + 6.8 GiB, and the margin is the planner's own (budget/20).
The report prefilled a 22,925-token prompt in one pass; the plan must derive a chunk that fits and refuse
--max-prefill-length 22925, naming the largest that fits.

    python benchmarks/dsv4_flash_plan.py     # about 4 minutes: one activation profile, then the cache
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS

FLAGS = ["--load-format", "dummy", "--max-model-len", "36864", "--max-num-seqs", "4", "--num-kv-blocks", "2048"]
HEADROOM_MIB = 2 * 3.4 * 1024  # the seed box's bf16 headroom, doubled for fp32


def write_config(out: Path) -> None:
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(
        vocab_size=129280, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6,
        n_routed_experts=8, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"], sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
        index_head_dim=128, index_topk=512, max_position_embeddings=65536,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1})
    config.architectures = ["DeepseekV4ForCausalLM"]
    config.save_pretrained(out)


def plan(model: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ladle.entrypoints.cli", "plan", "--model", str(model), *FLAGS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800)


def main() -> None:
    model = Path(tempfile.mkdtemp(prefix="dsv4-flash-"))
    write_config(model)
    first = plan(model)  # the whole RAM as the budget: what the fixed parts cost
    fixed = sum(float(m.group(2)) for m in re.finditer(r"^(weights|KV pool|state slots)\s+([\d.]+) MiB",
                                                         first.stdout, re.MULTILINE))
    budget = (fixed + HEADROOM_MIB) / 0.95
    derived = plan(model, "--memory-budget", f"{budget:.0f}MiB")
    refused = plan(model, "--memory-budget", f"{budget:.0f}MiB", "--max-prefill-length", "22925")
    keep = ("max_num_batched_tokens", "max_prefill_length", "memory budget", "weights", "KV pool", "activation",
            "state slots", "margin", "headroom", "KV group", "state group")
    shown = [x for x in derived.stdout.splitlines() if x.startswith(keep)]
    text = ["## DeepSeek-V4-Flash-shaped memory plan", "",
            "Flash-shaped `ladle plan` (the second seed report's model), fp32 on this CPU: "
            "`python benchmarks/dsv4_flash_plan.py`", "",
            f"Budget {budget:.0f} MiB: weights, KV pool and state slots plus 6.8 GiB, the seed box's 3.4 GiB of "
            "bf16 headroom doubled for fp32, over 0.95 (the planner keeps budget/20 as margin).", "",
            "```", *shown, "```", "",
            f"With `--max-prefill-length 22925` (the report's single pass), exit code {refused.returncode}:", "",
            "```", refused.stderr.strip().splitlines()[-1], "```", ""]
    (RESULTS / "dsv4_flash_plan.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
