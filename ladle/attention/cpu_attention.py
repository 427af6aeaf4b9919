"""The CPU attention backend: prefill chunks through the torch reference (its flash kernel is efficient for
many query rows), decode rows through ladle's C kernel, which reads K and V in place from the block pool.

For one query row torch has no fast path: gathering the context and calling the flash kernel (or a batched
matmul) runs at a fraction of memory bandwidth, and builds a dozen small tensors per layer. One layer, 8 decodes
at 512 tokens, 8 heads over 4 kv heads x 64, one thread (benchmarks/results/cpu_decode_attention.md): 2.2 ms in
torch, 0.63 ms in C (3.5x; bf16 7.6 ms against 0.63, 12x).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ladle.attention import torch_ref
from ladle.attention.backend import AttentionBackend, BackendMetadata, CacheKind
from ladle.attention.metadata import AttentionMetadata
from ladle.kernels.cpu_kernels import CpuKernels, KernelUnavailable
from ladle.kernels.cpu_kernels import load as load_cpu_kernels

_DTYPES = frozenset({torch.float32, torch.bfloat16})


@dataclass(frozen=True, kw_only=True)
class CpuAttentionMetadata(BackendMetadata):
    backend: CpuAttention
    # The step's decode rows as the C kernel reads them (sequences, query rows, tables, lengths), built by the
    # group's first layer that attends and reused by the rest of the step's layers.
    decode_plan: list[torch.Tensor] = field(default_factory=list, compare=False, repr=False)


class CpuAttention(AttentionBackend):
    """Decode rows in C (any window), prefill chunks in torch."""

    name: ClassVar[str] = "cpu"
    description: ClassVar[str] = "decode rows in ladle's C kernel (the KV pool read in place), prefills in torch"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    dtypes: ClassVar[frozenset[torch.dtype]] = _DTYPES
    kinds: ClassVar[frozenset[CacheKind]] = frozenset({CacheKind.FULL, CacheKind.SLIDING_WINDOW})
    # Named, it still leaves the groups the C kernel cannot read (DeepSeek-V4's shared K=V, fp16) to torch: its
    # prefills run there anyway.
    fallback: ClassVar[str | None] = "torch"
    metadata_cls: ClassVar[type[BackendMetadata]] = CpuAttentionMetadata

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            load_cpu_kernels()
        except KernelUnavailable as e:
            return f"needs ladle's C kernels, which are unavailable here ({e})"
        return None

    @classmethod
    def create(cls) -> CpuAttention:
        return cls(load_cpu_kernels())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.dtype != k_cache.dtype or q.dtype not in _DTYPES:
            return torch_ref.paged_attention(q, k, v, k_cache, v_cache, attn, scale)
        return torch_ref.paged_attention(q.contiguous(), k, v, k_cache, v_cache, attn, scale, decode=self._decode,
                                         write=self._write)

    def _write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        """torch_ref.write_kv's copy in one C call where k and v are rows of the caches' dtype."""
        _, _, kvh, hd = k_cache.shape
        ks, vs = k.stride(), v.stride()
        rows_fit = k.dtype == v.dtype == k_cache.dtype and ks[1:] == vs[1:] == (hd, 1)
        flat = slot_mapping.dtype == torch.int64 and all(t.is_contiguous() for t in (slot_mapping, k_cache, v_cache))
        if not (rows_fit and flat):
            return torch_ref.write_kv(k, v, k_cache, v_cache, slot_mapping)
        slots = k_cache.shape[0] * k_cache.shape[1]
        failed = self.kernels.paged_write_kv(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                             slot_mapping.data_ptr(), k.shape[0], ks[0], vs[0], kvh * hd,
                                             k.element_size(), slots)
        if failed:
            raise IndexError(f"a KV slot of {slot_mapping.tolist()} is outside the pool's {slots} slots")

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata,
                cu: list[int], decodes: list[tuple[int, int]], scale: float, out: torch.Tensor) -> None:
        # Metadata another builder made (a test's, a benchmark's) gets a plan for this call only.
        plan = attn.decode_plan if isinstance(attn, CpuAttentionMetadata) else []
        if not plan:
            plan += [torch.tensor([i for i, _ in decodes], dtype=torch.int64),
                     torch.tensor([cu[i] for i, _ in decodes], dtype=torch.int64),
                     attn.block_tables.to(torch.int32).contiguous(), attn.context_lens.to(torch.int32).contiguous()]
        seqs, rows, tables, lens = plan
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        failed = self.kernels.paged_decode_attention(
            q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), seqs.data_ptr(), rows.data_ptr(), len(decodes), num_heads,
            num_kv_heads, head_dim, k_cache.shape[1], scale, attn.sliding_window or 0,
            int(q.dtype == torch.bfloat16), torch.get_num_threads())
        if failed:
            raise MemoryError("the CPU decode attention kernel could not allocate its scratch memory")
