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

The report's engine ran the release files (FP8 linears, MXFP4 routed experts). So the same plan runs again at
the same budget on a checkpoint of the same shape written in the release's format (random weights, quantized
as ladle.testing.fp8_checkpoints writes them): its weights take their real bytes and the rest goes to
activations. And the full DeepSeek-V4-Flash (HF's DeepseekV4Config defaults: 43 layers, 256 experts of 2048,
hidden 4096) is built on the meta device to count its weight bytes in bf16 and in the release's formats.

    python benchmarks/dsv4_flash_plan.py     # about 8 minutes: two activation profiles, then the cache
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS

FLAGS = ["--max-model-len", "36864", "--max-num-seqs", "4", "--num-kv-blocks", "2048"]
HEADROOM_MIB = 2 * 3.4 * 1024  # the seed box's bf16 headroom, doubled for fp32


def flash_shaped_config():
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
    return config


def write_release_checkpoint(out: Path) -> None:
    """The Flash-shaped model with random weights, in the release's format."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    from ladle.testing.fp8_checkpoints import write_dsv4_release_checkpoint

    src = Path(tempfile.mkdtemp(prefix="dsv4-flash-src-"))
    torch.manual_seed(0)
    DeepseekV4ForCausalLM(flash_shaped_config()).save_pretrained(src)
    write_dsv4_release_checkpoint(src, out)


def full_flash_bytes() -> tuple[float, str]:
    """(bf16 GiB, the release's weights line) of the full DeepSeek-V4-Flash, counted on the meta device."""
    import torch
    from torch import nn
    from transformers import DeepseekV4Config

    from ladle.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from ladle.quantization.apply import use_fp8_linears, weights_format
    from ladle.quantization.config import quant_config_of
    from ladle.testing.fp8_checkpoints import dsv4_release_format

    config = DeepseekV4Config(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                   "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
                              expert_dtype="fp4")
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
        bf16 = sum(p.numel() * 2 for p in model.parameters()) / 2**30
        stored = {"fp8": ("F8_E4M3", "F8_E8M0"), "mxfp4": ("I8", "F8_E8M0")}
        dtypes: dict[str, str] = {}
        for name, module in model.named_modules():
            parts = module.fp8_checkpoint_parts(name) if hasattr(module, "fp8_checkpoint_parts") else (
                [name] if isinstance(module, nn.Linear) else [])
            for part in parts:
                if (fmt := dsv4_release_format(f"{part}.weight")) in stored:
                    dtypes[f"{part}.weight"], dtypes[f"{part}.weight_scale_inv"] = stored[fmt]
        use_fp8_linears(model, quant_config_of(config), dtypes)
        for name, p in model.named_parameters():  # the unquantized tensors as the release stores them
            if p.is_floating_point() and p.dtype == torch.float32 and dsv4_release_format(name) == "bf16":
                p.data = torch.empty(p.shape, dtype=torch.bfloat16)
        return bf16, weights_format(model)


def plan(model: Path, *extra: str, load_format: str = "dummy") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ladle.entrypoints.cli", "plan", "--model", str(model), "--load-format",
           load_format, *FLAGS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800)


def main() -> None:
    model = Path(tempfile.mkdtemp(prefix="dsv4-flash-"))
    flash_shaped_config().save_pretrained(model)
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
    release = Path(tempfile.mkdtemp(prefix="dsv4-flash-release-"))
    write_release_checkpoint(release)
    derived_q = plan(release, "--memory-budget", f"{budget:.0f}MiB", load_format="auto")
    refused_q = plan(release, "--memory-budget", f"{budget:.0f}MiB", "--max-prefill-length", "22925",
                     load_format="auto")
    bf16, line = full_flash_bytes()
    text += ["### The same plan from the release's files", "",
             "The same shape and budget, the checkpoint in DeepSeek's release format (FP8 e4m3 linears with E8M0 "
             "scales, MXFP4 routed experts, the rest bf16/fp32 as published), the model dtype fp32:", "",
             "```", *[x for x in derived_q.stdout.splitlines() if x.startswith(keep)], "```", "",
             f"With `--max-prefill-length 22925`, exit code {refused_q.returncode}:", "",
             "```", (refused_q.stderr.strip().splitlines() or ["(accepted)"])[-1], "```", "",
             "### The full DeepSeek-V4-Flash's weights", "",
             f"Counted on the meta device (HF's DeepseekV4Config defaults): bf16 {bf16:.1f} GiB; the release's "
             f"formats: {line}.", ""]
    (RESULTS / "dsv4_flash_plan.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
