"""TorchOps' math (the HF-exact torch versions) in ladle's C kernels on CPU (ladle/kernels/cpu/norm_rope.c): one
call per RMSNorm, residual add + RMSNorm, or q/k norm + rope instead of five to ten small torch ops, which is
what they cost on a decode step's few rows. Inputs the kernels do not cover (mixed dtypes, partial rope, very
wide rows) take the torch path."""
from __future__ import annotations

import torch

from ladle.kernels.cpu_kernels import CpuKernels
from ladle.models.layers.ops import TorchOps

_DTYPES = (torch.float32, torch.bfloat16)
_MAX_DIM = 16384  # norm_rope.c's MAX_DIM


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along the last dim (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    @staticmethod
    def _covered(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
        return (x.dtype in _DTYPES and x.shape[-1] <= _MAX_DIM and x.device.type == "cpu"
                and all(t is None or (t.dtype == x.dtype and t.is_contiguous()) for t in others))

    # an instance method over TorchOps' static one: it reads the instance's C kernels (callers hold an ops instance)
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        if not self._covered(x, weight) or x.numel() == 0:
            return TorchOps.rms_norm(x, weight, eps)
        x2 = _rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        self.kernels.rms_norm(x2.data_ptr(), x2.stride(0), weight.data_ptr(), out.data_ptr(), x2.shape[0],
                              x2.shape[1], eps, int(x.dtype == torch.bfloat16), torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if (not self._covered(x, weight, residual) or not x.is_contiguous() or x.shape != residual.shape
                or x.numel() == 0):
            return TorchOps.add_rms_norm(self, x, residual, weight, eps)
        out, total = torch.empty_like(x), torch.empty_like(x)
        self.kernels.add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                  total.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps,
                                  int(x.dtype == torch.bfloat16), torch.get_num_threads())
        return out, total

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, kvh, D] (views of the qkv projection), cos/sin [T, D]."""
        normed = q_w is not None and k_w is not None
        ok = (self._covered(q, q_w, k_w, cos, sin) and k.dtype == q.dtype and cos.shape[-1] == q.shape[-1]
              and q.numel() > 0)
        if not ok:
            return TorchOps.qk_norm_rope(self, q, k, q_w, k_w, cos, sin, eps)
        return (self._norm_rope(q, q_w if normed else None, cos, sin, eps),
                self._norm_rope(k, k_w if normed else None, cos, sin, eps))

    def _norm_rope(self, x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float) -> torch.Tensor:
        t, heads, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d:
            x = x.contiguous()
        out = torch.empty(t, heads, d, dtype=x.dtype)
        self.kernels.norm_rope(x.data_ptr(), x.stride(0), None if weight is None else weight.data_ptr(),
                               cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, heads, d, eps,
                               int(x.dtype == torch.bfloat16), torch.get_num_threads())
        return out
