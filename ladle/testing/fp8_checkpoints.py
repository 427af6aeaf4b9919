"""Release-format checkpoints for the tests and benchmarks, written from an unquantized one: every linear projection's weight as
block-scaled FP8 (e4m3 values, one fp32 `weight_scale_inv` per block, as Qwen3's FP8 releases ship them), the
rest as it was, and `quantization_config` in config.json."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
Edit = Callable[[dict[str, torch.Tensor]], None]


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [out, in], fp32 scales [ceil(out / rows), ceil(in / cols)]) with value x scale ~ weight;
    a partial edge block has a scale of its own, from its own entries."""
    rows, cols = block
    out, inp = weight.shape
    grid = (-(-out // rows), -(-inp // cols))
    padded = torch.zeros(grid[0] * rows, grid[1] * cols)
    padded[:out, :inp] = weight.float()
    tiles = padded.view(grid[0], rows, grid[1], cols)
    scales = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / E4M3_MAX
    values = (tiles / scales[:, None, :, None]).view_as(padded)[:out, :inp].to(torch.float8_e4m3fn)
    return values, scales


def write_fp8_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128),
                         edit: Edit | None = None) -> str:
    """dst: src with every `*_proj.weight` matrix quantized; edit(tensors) may break the tensors before they
    are saved (the bad-file tests)."""
    src, dst = Path(src), Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.endswith("_proj.weight") and tensor.dim() == 2:
            values, scales = quantize_block_fp8(tensor, block)
            tensors[name] = values
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scales
        else:
            tensors[name] = tensor
    if edit is not None:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return str(dst)


def hf_dequantized(path: str) -> torch.nn.Module:
    """HF transformers loading the same files, dequantized on CPU: the oracle."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                dtype=torch.float32).eval()
