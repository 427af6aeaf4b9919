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


def use_fp8_linears(model: nn.Module, quant: QuantConfig, dtypes: dict[str, str]) -> int:
    """Replace each nn.Linear whose checkpoint weights are FP8 by an Fp8Linear (a stacked one only if every part
    is); returns how many. A scale with no FP8 weight, or a weight FP8 where the config has no block size, fails
    with the tensor named."""
    replaced = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            full = f"{prefix}.{name}" if prefix else name
            shards = getattr(child, "shards", None)
            owner = full.rsplit(".", 1)[0] if "." in full else ""
            parts = [f"{owner}.{s}" if owner else s for s in shards] if shards else [full]
            kinds = {p: dtypes.get(f"{p}.weight") for p in parts}
            fp8 = [p for p, k in kinds.items() if k == FP8_DTYPE]
            if not fp8:
                continue
            if len(fp8) != len(parts):
                raise ValueError(f"{full} stacks {parts}, of which only {fp8} are FP8 in the checkpoint; ladle needs "
                                 "all of them quantized or none")
            for p in parts:
                if f"{p}.weight_scale_inv" not in dtypes:
                    raise ValueError(f"{p}.weight is FP8 but the checkpoint has no {p}.weight_scale_inv")
                if dtypes[f"{p}.weight_scale_inv"] != "F32":
                    raise ValueError(f"{p}.weight_scale_inv is {dtypes[f'{p}.weight_scale_inv']}; block-scaled FP8 "
                                     "checkpoints store these scales as F32")
            setattr(parent, name, Fp8Linear(child.in_features, child.out_features, child.bias is not None,
                                            quant.block, getattr(child, "shards", None)))
            replaced += 1
    return replaced


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
