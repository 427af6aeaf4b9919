"""Which linears of a model hold FP8 weights, read from the checkpoint's own tensor dtypes (the safetensors
headers, no tensor read), and their replacement by Fp8Linear before any storage is allocated."""
from __future__ import annotations

from torch import nn

from ladle.quantization.config import FP8_DTYPE, QuantConfig
from ladle.quantization.fp8_linear import Fp8Linear


def checkpoint_dtypes(files: list[str]) -> dict[str, str]:
    """Tensor name -> its safetensors dtype ('F8_E4M3', 'BF16', ...)."""
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                dtypes[name] = f.get_slice(name).get_dtype()
    return dtypes


def _all_fp8(full: str, parts: list[str], dtypes: dict[str, str]) -> bool:
    """Whether the checkpoint modules `parts` (which layer `full` holds) are FP8: all, or none; anything between,
    a missing scale or a scale that is not F32 fails with the tensor named."""
    fp8 = [p for p in parts if dtypes.get(f"{p}.weight") == FP8_DTYPE]
    if not fp8:
        return False
    if len(fp8) != len(parts):
        raise ValueError(f"{full} stacks {parts}, of which only {fp8} are FP8 in the checkpoint; ladle needs all "
                         "of them quantized or none")
    for p in parts:
        scale = dtypes.get(f"{p}.weight_scale_inv")
        if scale is None:
            raise ValueError(f"{p}.weight is FP8 but the checkpoint has no {p}.weight_scale_inv")
        if scale != "F32":
            raise ValueError(f"{p}.weight_scale_inv is {scale}; block-scaled FP8 checkpoints store these scales "
                             "as F32")
    return True


def use_fp8_linears(model: nn.Module, quant: QuantConfig, dtypes: dict[str, str]) -> int:
    """Replace each nn.Linear whose checkpoint weights are FP8 by an Fp8Linear (a stacked one only if every part
    is), and switch stacked experts (a module with use_fp8) to their FP8 form; returns how many layers. A
    module the config lists in modules_to_not_convert must not be FP8 in the files."""
    for name, dtype in dtypes.items():
        if dtype == FP8_DTYPE and any(skip and skip in name for skip in quant.modules_to_not_convert):
            raise ValueError(f"{name} is FP8, but quantization_config.modules_to_not_convert lists it as unquantized")
    replaced = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{prefix}.{name}" if prefix else name
            if hasattr(child, "use_fp8"):
                if _all_fp8(full, child.fp8_checkpoint_parts(full), dtypes):
                    child.use_fp8(quant.block)
                    replaced += 1
                continue
            if not isinstance(child, nn.Linear):
                continue
            shards = getattr(child, "shards", None)
            owner = full.rsplit(".", 1)[0] if "." in full else ""
            parts = [f"{owner}.{s}" if owner else s for s in shards] if shards else [full]
            if _all_fp8(full, parts, dtypes):
                setattr(parent, name, Fp8Linear(child.in_features, child.out_features, child.bias is not None,
                                                quant.block, shards))
                replaced += 1
    return replaced

def with_scale_slices(slices: dict, block: tuple[int, int], dtypes: dict[str, str]) -> dict:
    """A tensor-parallel rank's slices (ladle.models.tensor_parallel) with each FP8 weight's scale grid cut
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


def weights_format(model: nn.Module) -> str:
    """What the weight bytes are, for the plan's weights line ('' when all are in the model dtype)."""
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if not fp8:
        return ""
    quantized = {id(t) for m in fp8 for t in (m.weight, m.weight_scale_inv)}
    q_bytes = sum(t.numel() * t.element_size() for m in fp8 for t in (m.weight, m.weight_scale_inv))
    rest = {str(t.dtype).removeprefix("torch."): 0 for t in model.parameters() if id(t) not in quantized}
    for t in model.parameters():
        if id(t) not in quantized:
            rest[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    others = ", ".join(f"{name} {n / 2**20:.1f} MiB" for name, n in rest.items())
    return f"FP8 e4m3 + fp32 scales {q_bytes / 2**20:.1f} MiB in {len(fp8)} linears; {others}"
