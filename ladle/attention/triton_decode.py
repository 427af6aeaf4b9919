"""Split-KV (flash-decoding) attention for decode-only steps.

A decode has one query token per request, so the paged kernel of ladle.attention.triton_attention runs one
program per (request, KV head), each walking its whole context: at batch 1 on an 8-KV-head model that is 8
programs on a 132-SM GPU, reading a 128K context serially. Here each (request, KV head) is cut into
num_splits key ranges processed in parallel; each writes its normalised partial output and log-sum-exp
(base 2) to a small fp32 workspace, and a second kernel merges the partials per (request, head).

The number of splits depends only on batch size and head count, and each program derives its key range
from the context length on the device, so the launches need no host data and a CUDA graph captured for a
batch size stays valid at every context length. Padding rows of a graph batch (context 0) get empty
ranges everywhere and produce zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle.attention.metadata import AttentionMetadata
from ladle.attention.triton_tile import LOG2E, attend_kv_tile

# Not yet tuned on a GPU (benchmarks/gpu_kernels.py kernel_speed measures them). WAVES: programs per SM to
# aim for, since one wave leaves SMs idle while the slowest programs finish; MAX_SPLITS bounds the merge's
# work and workspace (batch 1 x 8 KV heads reaches 2 waves on 132 SMs at 33 splits).
MAX_SPLITS = 64
WAVES = 2


def num_splits_for(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (request, KV head) so that a decode step runs about WAVES programs per SM; 1 when the batch
    already has that many. Shapes only, so the answer is fixed per CUDA-graph batch size. On CPU (the
    interpreter, tests and the CPU engine) 1: the split path runs there only when a caller asks for it."""
    if device.type != "cuda":
        return 1
    target = WAVES * torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(MAX_SPLITS, triton.cdiv(target, programs)))


# The block-table width changes every step; without this Triton would compile a variant per alignment class.
@triton.jit(do_not_specialize=["stride_bt"])
def _split_kv_decode_kernel(
    q, k_cache, v_cache, part_out, part_lse, cu_seqlens_q, context_lens, block_tables,
    qk_scale, window, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (seq, kv_head, split): the GROUP query heads of kv_head (rows of one tile, so a single dot
    serves them) over keys [split * part, (split + 1) * part) of the request's context."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * GROUP
    ctx = tl.load(context_lens + seq)
    # The keys the query (the last token) sees: all of them, or the window's (0: none) last `window`.
    start0 = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    # Whole key tiles per split, so no tile straddles two splits and every split but the last is full.
    part = tl.cdiv(tl.cdiv(ctx - start0, num_splits), BLOCK_N) * BLOCK_N
    lo = start0 + split * part
    hi = tl.minimum(lo + part, ctx)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_row = tl.load(cu_seqlens_q + seq).to(tl.int64)
    qt = tl.load(q + q_row * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: an empty range must not give inf - inf
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    # A decode's token is the last of its context, so every key below ctx is visible: no causal mask.
    for start in range(lo, hi, BLOCK_N):
        kn = start + tl.arange(0, BLOCK_N)
        k_ok = kn < hi
        m_i, l_i, acc = attend_kv_tile(qt, m_i, l_i, acc, k_cache, v_cache, table, kn, k_ok, k_ok[None, :], kv_head,
                                       d, d_ok, qk_scale, stride_cb, stride_cs, stride_ch, PAGE, UPCAST, PRECISION)

    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o = acc / tl.where(empty, 1.0, l_i)[:, None]  # zeros for an empty range: the merge weighs them by 0
    # Workspace [num_seqs, H, num_splits(, HEAD_DIM)], contiguous, so its offsets follow from the grid.
    part_row = (seq.to(tl.int64) * num_heads + head) * num_splits + split
    tl.store(part_lse + part_row, lse, mask=row_ok)
    tl.store(part_out + part_row[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])


# num_splits follows the batch size: batch sizes whose split counts share a BLOCK_S share a compiled variant.
@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_out, part_lse, out, cu_seqlens_q, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (seq, head): out = sum_i exp2(lse_i - lse) * out_i over the splits, lse their log-sum-exp."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse + base + splits, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (a padding row): weights 0, not NaN
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    parts = tl.load(part_out + (base + splits)[:, None] * HEAD_DIM + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    row = tl.load(cu_seqlens_q + seq).to(tl.int64)
    tl.store(out + row * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty), mask=d_ok)


def _default_block_n(head_dim: int, device: torch.device) -> int:
    # As the paged kernel's decode tiles: 64 keys fit registers up to head_dim 128; the interpreter runs
    # every lane in numpy, so 16 keeps the CPU tests fast.
    if device.type != "cuda":
        return 16
    return 64 if head_dim <= 128 else 32


def split_kv_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, scale: float,
    num_splits: int, out: torch.Tensor, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of a decode-only step (one query row per request), written into out [T, H, D]. The caller
    (triton_attention.attention) has validated the shapes and layouts; k/v pools share their strides."""
    num_seqs = attn.num_seqs
    num_heads, head_dim = q.shape[1:]
    page, kvh = k_cache.shape[1:3]
    group = num_heads // kvh
    on_gpu = q.device.type == "cuda"
    upcast = not on_gpu and q.dtype == torch.bfloat16  # the interpreter's bf16 dots are wrong
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _split_kv_decode_kernel[(num_seqs, kvh, num_splits)](
        q, k_cache, v_cache, part_out, part_lse, attn.cu_seqlens_q, attn.context_lens, attn.block_tables,
        scale * LOG2E, attn.sliding_window or 0, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), attn.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n or _default_block_n(head_dim, q.device),
        UPCAST=upcast, PRECISION=precision,
        num_warps=num_warps or (4 if on_gpu else 1), num_stages=num_stages or (2 if on_gpu else 1),
    )
    _merge_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, attn.cu_seqlens_q, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4 if on_gpu and head_dim >= 128 else 1,
    )
    return out
