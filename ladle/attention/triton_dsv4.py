"""DeepSeek-V4 attention on CUDA: one program per (query token, block of heads) walks the token's sliding window
in the paged pool, then the compressed entries it sees, with an online softmax that starts from each head's
sink logit (mass, no value). Keys are values (one shared K=V head).

The entries a token sees are given as rows of the entries pool, -1 for none (HCA: every complete entry;
CSA: the indexer's picks), so one kernel serves both kinds of compressed layer and the sliding-only one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dsv4_attention_kernel(q_ptr, pool_ptr, ent_ptr, table_ptr, req_ptr, pos_ptr, extra_ptr, sink_ptr, out_ptr,
                           stride_qt, stride_qh, stride_table, stride_extra, stride_ot, stride_oh, num_extra,
                           scale, window, num_heads,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    m = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)  # the sink: exp(sink - m) = 1
    denom = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    req = tl.load(req_ptr + t)
    pos = tl.load(pos_ptr + t)
    first = tl.maximum(pos - window + 1, 0)
    for start in range(first, pos + 1, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        ok = key_pos <= pos
        block = tl.load(table_ptr + req * stride_table + key_pos // BLOCK_SIZE, mask=ok, other=0)
        rows = block.to(tl.int64) * BLOCK_SIZE + key_pos % BLOCK_SIZE
        k = tl.load(pool_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None] & dim_ok[None, :],
                    other=0.0).to(tl.float32)
        m, denom, acc = _update(q, k, ok, m, denom, acc, scale, PRECISION)
    for start in range(0, num_extra, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        rows = tl.load(extra_ptr + t * stride_extra + idx, mask=idx < num_extra, other=-1)
        ok = rows >= 0
        k = tl.load(ent_ptr + rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :],
                    mask=ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        m, denom, acc = _update(q, k, ok, m, denom, acc, scale, PRECISION)
    out = acc / denom[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


@triton.jit
def _update(q, k, ok, m, denom, acc, scale, PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [heads, keys]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, denom * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p, k, input_precision=PRECISION)


def dsv4_attention(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, row_request: torch.Tensor,
                   positions: torch.Tensor, window: int, block_size: int, entries: torch.Tensor,
                   extra: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; pool [rows, D] the window's K=V vectors, table [B, blocks] its block table, row_request
    [T] each token's row of it; extra [T, E] rows of entries [rows, D] each token also attends (-1: none);
    sinks [H] fp32 -> [T, H, D]. Products in fp32 (exact IEEE ones for an fp32 model, so it can match HF)."""
    t, heads, dim = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    block_h = 16
    grid = (t, triton.cdiv(heads, block_h))
    extra = extra.contiguous()
    _dsv4_attention_kernel[grid](
        q, pool, entries, table, row_request, positions, extra, sinks, out,
        q.stride(0), q.stride(1), table.stride(0), extra.stride(0), out.stride(0), out.stride(1), extra.shape[1],
        scale, window, heads, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_H=block_h, BLOCK_N=32,
        BLOCK_SIZE=block_size, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
