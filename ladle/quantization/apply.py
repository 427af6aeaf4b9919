"""Which linears of a model hold FP8 weights, read from the checkpoint's own tensor dtypes (the safetensors
headers, no tensor read), and their replacement by Fp8Linear before any storage is allocated."""
from __future__ import annotations

import torch
from torch import nn

from ladle.quantization.config import E8M0_DTYPE, FP4_DTYPE, FP8_DTYPE, QuantConfig
from ladle.quantization.fp8_linear import Fp8Linear
from ladle.quantization.ggml_embedding import GgmlEmbedding
from ladle.quantization.ggml_linear import GgmlLinear
from ladle.quantization.layer_interfaces import QuantizableExperts, StackedProjections


def checkpoint_dtypes(files: list[str]) -> dict[str, str]:
    """Tensor name -> its safetensors dtype ('F8_E4M3', 'BF16', ...)."""
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 -- safe_open has keys(), not iteration
                dtypes[name] = f.get_slice(name).get_dtype()
    return dtypes


def scale_names(dtypes: dict[str, str]) -> dict[str, str]:
    """Checkpoint name -> ladle's for each quantized weight's scale: DeepSeek-V4 names it `<w>.scale`, Qwen3
    `<w>.weight_scale_inv`; ladle's parameters take the second (as HF renames on load)."""
    quantized = (FP8_DTYPE, FP4_DTYPE)
    return {name: name.removesuffix("scale") + "weight_scale_inv" for name in dtypes
            if name.endswith(".scale") and dtypes.get(name.removesuffix("scale") + "weight") in quantized}


def _all_quantized(full: str, parts: list[str], dtypes: dict[str, str], values: str, scales: str,
                   what: str) -> bool:
    """Whether the checkpoint modules `parts` (which layer `full` holds) are quantized as `what` (weights of
    safetensors dtype `values`, scales of `scales`): all, or none; anything between, a missing scale or a
    weight or scale of another dtype fails with the tensor named."""
    quantized = [p for p in parts if dtypes.get(f"{p}.weight") in (FP8_DTYPE, FP4_DTYPE)]
    if not quantized:
        return False
    if len(quantized) != len(parts):
        raise ValueError(f"{full} stacks {parts}, of which only {quantized} are quantized in the checkpoint; "
                         "ladle needs all of them quantized or none")
    for p in parts:
        if dtypes[f"{p}.weight"] != values:
            raise ValueError(f"{p}.weight is {dtypes[f'{p}.weight']}, but quantization_config makes this layer "
                             f"{what}, stored as {values}")
        scale = dtypes.get(f"{p}.weight_scale_inv")
        if scale is None:
            raise ValueError(f"{p}.weight is quantized but the checkpoint has no scale for it ({p}.weight_scale_inv "
                             f"or {p}.scale)")
        if scale != scales:
            raise ValueError(f"{p}'s scales are {scale}, but this checkpoint's {what} stores them as {scales} "
                             "(quantization_config.scale_fmt says which: 'ue8m0' E8M0 bytes, 'float' fp32)")
    return True


def use_fp8_linears(model: nn.Module, quant: QuantConfig, dtypes: dict[str, str]) -> int:
    """Replace each nn.Linear whose checkpoint weights are FP8 by an Fp8Linear (a stacked one only if every part
    is), and switch stacked experts (QuantizableExperts) to FP8 or, expert_dtype fp4, MXFP4; returns how
    many layers. dtypes: tensor name -> safetensors dtype, scales under ladle's names (scale_names). A module
    the config lists in modules_to_not_convert must not be quantized in the files."""
    for name, dtype in dtypes.items():
        if dtype == FP8_DTYPE and any(skip and skip in name for skip in quant.modules_to_not_convert):
            raise ValueError(f"{name} is FP8, but quantization_config.modules_to_not_convert lists it as unquantized")
    scale_dtype = torch.float8_e8m0fnu if quant.scale_fmt == "ue8m0" else torch.float32
    fp8 = (FP8_DTYPE, quant.scale_dtype, f"FP8 e4m3 with {quant.scale_dtype} block scales")
    replaced = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(child, QuantizableExperts):
                mxfp4 = quant.expert_dtype == "fp4"
                expected = (FP4_DTYPE, E8M0_DTYPE, "MXFP4 (expert_dtype fp4)") if mxfp4 else fp8
                if _all_quantized(full, child.fp8_checkpoint_parts(full), dtypes, *expected):
                    child.use_mxfp4() if mxfp4 else child.use_fp8(quant.block, scale_dtype)
                    replaced += 1
                continue
            if not isinstance(child, nn.Linear):
                continue
            shards = child.shards if isinstance(child, StackedProjections) else None
            owner = full.rsplit(".", 1)[0] if "." in full else ""
            parts = [f"{owner}.{s}" if owner else s for s in shards] if shards else [full]
            if _all_quantized(full, parts, dtypes, *fp8):
                setattr(parent, name, Fp8Linear(child.in_features, child.out_features, child.bias is not None,
                                                quant.block, shards, scale_dtype))
                replaced += 1
    return replaced


def with_scale_slices(slices: dict, block: tuple[int, int], dtypes: dict[str, str]) -> dict:
    """A tensor-parallel rank's slices (ladle.models.loading.tensor_parallel) with each FP8 weight's scale grid cut
    alike: the rows or columns of the blocks its slice covers. A slice off the block grid would split a scale
    between ranks: refused with the reason."""
    out = dict(slices)
    for name, part in slices.items():
        scale = name.removesuffix("weight") + "weight_scale_inv"
        if part is None or not name.endswith(".weight") or scale not in dtypes:
            continue
        unit = block[part.dim]
        if part.start % unit or part.size % unit:
            raise ValueError(f"{name}: this rank's part [{part.start}, {part.start + part.size}) is off the "
                             f"{unit}-wide FP8 block grid, so a scale would be split between ranks; choose a "
                             "tensor_parallel_size that keeps each rank's share a whole number of blocks")
        out[scale] = type(part)(part.dim, part.start // unit, part.size // unit)
    return out


@torch.no_grad()
def dequantize_layers(model: nn.Module, dtype: torch.dtype) -> int:
    """Widen every quantized layer to dtype, once, after loading (--dequantize-weights): an Fp8Linear becomes
    an nn.Linear, quantized experts dense stacks; returns how many layers."""
    widened = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Fp8Linear):
                dense = nn.Linear(child.in_features, child.out_features, child.bias is not None,
                                  device=child.weight.device, dtype=dtype)
                dense.weight.copy_(child.dequantized(0, child.out_features, dtype))
                if child.bias is not None:
                    dense.bias.copy_(child.bias)
                setattr(parent, name, dense.requires_grad_(False))
                widened += 1
            elif isinstance(child, QuantizableExperts) and child.weight_format is not None:
                child.dequantize(dtype)
                widened += 1
    return widened


def weights_format(model: nn.Module) -> str:
    """What the weight bytes are, for the plan's weights line ('' when all are in the model dtype): each
    quantized format's bytes with their scales', then the rest by dtype."""
    groups: dict[str, list[torch.Tensor]] = {}
    layers: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (GgmlLinear, GgmlEmbedding)):  # a GGUF file's blocks: scales inside them
            key = f"GGUF {module.qtype} blocks"
            if all(module.weight is not t for t in groups.get(key, [])):  # a tied head shares the embedding's
                groups.setdefault(key, []).append(module.weight)
                layers[key] = layers.get(key, 0) + 1
            continue
        if isinstance(module, Fp8Linear):
            fmt: str | None = "fp8"
        elif isinstance(module, QuantizableExperts) and not module.is_tiered:  # tiered: the plan's own line
            fmt = module.weight_format
        else:
            continue
        if fmt is None:
            continue
        names = (("weight", "weight_scale_inv") if isinstance(module, Fp8Linear)  # else a quantized FusedMoE's
                 else ("w13", "w2", "w13_scale_inv", "w2_scale_inv"))
        tensors: list[torch.Tensor] = [getattr(module, n) for n in names]
        scales = "E8M0" if tensors[-1].dtype == torch.float8_e8m0fnu else "fp32"
        key = "MXFP4 + E8M0 scales" if fmt == "mxfp4" else f"FP8 e4m3 + {scales} scales"
        groups.setdefault(key, []).extend(tensors)
        layers[key] = layers.get(key, 0) + 1
    if not groups:
        return ""
    quantized = {id(t) for ts in groups.values() for t in ts}
    rest: dict[str, int] = {}
    for t in model.parameters():
        if id(t) not in quantized:
            name = str(t.dtype).removeprefix("torch.")
            rest[name] = rest.get(name, 0) + t.numel() * t.element_size()
    parts = [f"{key} {sum(t.numel() * t.element_size() for t in ts) / 2**20:.1f} MiB in {layers[key]} layers"
             for key, ts in groups.items()]
    return "; ".join(parts) + "; " + ", ".join(f"{name} {n / 2**20:.1f} MiB" for name, n in rest.items())
