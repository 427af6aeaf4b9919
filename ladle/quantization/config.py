"""A checkpoint's quantization, read from config.json's `quantization_config` and checked field by field.

ladle reads what the release files hold: block-scaled FP8 (`quant_method: fp8`, e4m3 values with one scale per
`weight_block_size` block: fp32 `weight_scale_inv` as Qwen3's FP8 releases ship it, or, `scale_fmt: ue8m0`, E8M0
power-of-two `scale` as DeepSeek-V4's do), and DeepSeek-V4's MXFP4 routed experts (`expert_dtype: fp4`: two
e2m1 values a byte, one E8M0 scale per 32 inputs). A field ladle does not implement is refused with its name,
never ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP8_DTYPE = "F8_E4M3"  # safetensors' name for torch.float8_e4m3fn
E8M0_DTYPE = "F8_E8M0"  # torch.float8_e8m0fnu: a byte b is 2^(b - 127)
FP4_DTYPE = "I8"  # MXFP4 values: two e2m1 nibbles a byte in an int8 container, the low nibble first
MXFP4_GROUP = 32  # inputs per MXFP4 scale


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8"
    block: tuple[int, int]  # (rows, columns) of the weight each scale covers
    activation_scheme: str  # "dynamic": ladle keeps weights FP8 and computes in the model dtype (weight-only)
    modules_to_not_convert: tuple[str, ...] = ()
    scale_fmt: str = "float"  # "float": fp32 scales; "ue8m0": E8M0 bytes
    expert_dtype: str = "fp8"  # routed experts' format: "fp8" as the linears, or "fp4" (MXFP4)

    @property
    def scale_dtype(self) -> str:
        """The safetensors dtype every FP8 scale must have."""
        return E8M0_DTYPE if self.scale_fmt == "ue8m0" else "F32"

    def describe(self) -> str:
        scales = "E8M0" if self.scale_fmt == "ue8m0" else "fp32"
        experts = "; routed experts MXFP4 (e2m1, E8M0 scale per 32)" if self.expert_dtype == "fp4" else ""
        return f"FP8 e4m3, {self.block[0]}x{self.block[1]} blocks, {scales} scales{experts}"


_KNOWN = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
          "ignored_layers", "dequantize", "scale_fmt", "expert_dtype"}


def quant_config_of(config: Any) -> QuantConfig | None:
    """The config's quantization (None if unquantized); ValueError naming what ladle cannot serve."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    method = raw.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; ladle reads block-scaled "
                         "'fp8' checkpoints")
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise ValueError(f"quantization_config has fields ladle does not implement: {unknown}")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {raw['fmt']!r} is not supported; only 'e4m3'")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported; only 'dynamic' "
                         "(static activation scales are not read)")
    block = raw.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block!r} (per-tensor "
                         "FP8 is not supported)")
    if raw.get("dequantize"):
        raise ValueError("quantization_config.dequantize is set; ladle keeps FP8 weights quantized (drop the field)")
    scale_fmt = raw.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"quantization_config.scale_fmt {scale_fmt!r} is not supported; 'float' or 'ue8m0'")
    # DeepSeek-V4's config.json has expert_dtype at the top level; V4.1 and HF's config move it in here.
    expert_dtype = raw.get("expert_dtype") or getattr(config, "expert_dtype", None) or "fp8"
    if expert_dtype not in ("fp8", "fp4"):
        raise ValueError(f"expert_dtype {expert_dtype!r} is not supported; 'fp8' or 'fp4' (MXFP4)")
    skip = tuple(raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ())
    return QuantConfig("fp8", (block[0], block[1]), scheme, skip, scale_fmt, expert_dtype)


def resolve_quantization(requested: str | None, config: Any) -> tuple[QuantConfig | None, str, str]:
    """(the checkpoint's quantization, the setting's value, why): an explicit value must be the checkpoint's."""
    quant = quant_config_of(config)
    found = quant.method if quant is not None else None
    if requested is not None and requested != found:
        raise ValueError(f"quantization={requested!r} but the checkpoint is "
                         f"{'unquantized' if found is None else repr(found)}; ladle serves weights as their files "
                         "hold them: drop quantization")
    if quant is None:
        return None, "none", "the checkpoint has no quantization_config"
    return quant, quant.method, f"the checkpoint's quantization_config: {quant.describe()}"
