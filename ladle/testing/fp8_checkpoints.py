"""Release-format checkpoints for the tests and benchmarks, written from an unquantized one:
- Qwen3's FP8 releases: every linear projection's weight as block-scaled FP8 (e4m3 values, one fp32
  `weight_scale_inv` per block), the rest as it was;
- DeepSeek-V4's: attention, shared-expert and indexer-query linears FP8 with E8M0 `scale`s per 128x128 block,
  routed experts MXFP4 (e2m1 nibbles in int8, an E8M0 `scale` per 32 inputs), the other weights bf16 and
  hyper-connection, sink, gate-bias and compressor-position tensors fp32, with DeepSeek's names (no `model.` prefix);
and `quantization_config` in config.json."""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

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


def _pow2_scales(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The power of two each group is divided by so its largest magnitude fits the format's top value."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(2.0**-100) / top)))


def quantize_block_fp8_e8m0(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """As quantize_block_fp8, with power-of-two scales stored as E8M0 bytes (DeepSeek-V4's scale_fmt ue8m0)."""
    _, scales = quantize_block_fp8(weight, block)
    pow2 = _pow2_scales(scales * E4M3_MAX, E4M3_MAX)
    rows, cols = block
    grid = pow2.repeat_interleave(rows, 0)[: weight.shape[0]].repeat_interleave(cols, 1)[:, : weight.shape[1]]
    return (weight.float() / grid).to(torch.float8_e4m3fn), pow2.to(torch.float8_e8m0fnu)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in / 2] with two e2m1 codes a byte, the even input in the low nibble; E8M0 [out, in / 32]),
    each value rounded to the nearest e2m1 (ties to the smaller magnitude)."""
    out, inp = weight.shape
    groups = weight.float().view(out, inp // 32, 32)
    scales = _pow2_scales(groups.abs().amax(-1), 6.0)
    x = (groups / scales[..., None]).view(out, inp)
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = torch.bucketize(x.abs(), (magnitudes[1:] + magnitudes[:-1]) / 2) | ((x < 0).long() << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scales.to(torch.float8_e8m0fnu)


_DSV4_FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|shared_experts\.w[123]|indexer\.wq_b)\.weight$")
_DSV4_FP4 = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
_DSV4_FP32 = re.compile(r"(hc_\w+|attn_sink|\.ape|gate\.bias)$")


def dsv4_release_format(name: str) -> str:
    """What DeepSeek-V4's release stores the tensor `name` (DeepSeek's name) as: 'fp8', 'mxfp4', 'fp32' or
    'bf16' (a floating tensor; integer ones, the hash tables, are kept as they are)."""
    if _DSV4_FP8.search(name):
        return "fp8"
    if _DSV4_FP4.search(name):
        return "mxfp4"
    return "fp32" if _DSV4_FP32.search(name) else "bf16"


def write_dsv4_release_checkpoint(src: str | Path, dst: str | Path, edit: Edit | None = None) -> str:
    """dst: a DeepSeek-V4 checkpoint (as HF saves it) in the release's format; edit as write_fp8_checkpoint's."""
    src, dst = Path(src), Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        name = name.removeprefix("model.").replace("embed_tokens.", "embed.").replace("lm_head.", "head.")
        scale, fmt = name.removesuffix("weight") + "scale", dsv4_release_format(name)
        if fmt == "fp8":
            tensors[name], tensors[scale] = quantize_block_fp8_e8m0(tensor, (128, 128))
        elif fmt == "mxfp4":
            tensors[name], tensors[scale] = quantize_mxfp4(tensor)
        else:
            tensors[name] = tensor.to(torch.bfloat16) if fmt == "bf16" and tensor.is_floating_point() else tensor
    if edit is not None:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    config["expert_dtype"] = "fp4"
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return str(dst)


def write_fp8_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128),
                         edit: Edit | None = None, expert_dtype: str = "fp8") -> str:
    """dst: src with every `*_proj.weight` matrix quantized, and Qwen3.5's Gated DeltaNet `in_proj_qkv` and
    `in_proj_z` (its `in_proj_b` and `in_proj_a`, a row per value head, stay unquantized); edit(tensors) may
    break the tensors before they are saved (the bad-file tests); expert_dtype "fp4": routed experts' weights
    MXFP4 instead, with E8M0 scales, as DeepSeek-V4 ships its own."""
    src, dst = Path(src), Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if expert_dtype == "fp4" and re.search(r"\.experts\.\d+\.\w+_proj\.weight$", name):
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize_mxfp4(tensor)
        elif name.endswith(("_proj.weight", "in_proj_qkv.weight", "in_proj_z.weight")) and tensor.dim() == 2:
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
                                     "weight_block_size": list(block), "expert_dtype": expert_dtype}
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return str(dst)


def hf_dequantized(path: str) -> torch.nn.Module:
    """HF transformers loading the same files, dequantized on CPU: the oracle."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                dtype=torch.float32).eval()
