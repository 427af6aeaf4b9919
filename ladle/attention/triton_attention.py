"""Triton attention over the paged KV cache for CUDA: one launch serves a whole mixed step.

Every request of a step (a prefill chunk at any offset, or a single decode token) is handled by the same
kernel: each program takes a tile of one request's query tokens for one KV head, walks that request's
context straight out of the pool through its block table, and keeps a running (online) softmax, so no
context is ever gathered into a new tensor and workspace does not grow with context length.

GQA: the query heads that share a KV head are packed into the rows of one tile (row r is token r // G,
head r % G), so a decode's G heads fill one matrix multiply and each KV tile is read once per group.

A program finds its request by binary search over cu_seqlens_q on the device, so a launch needs only
tensor shapes from the host: no device-to-host sync, and the launch can be captured in a CUDA graph.

A decode-only step with too few (request, KV head) pairs to fill the GPU instead splits each context across
programs (flash-decoding, ladle.attention.triton_decode): one program per pair would read a long context alone.

CPU tensors mean Triton's interpreter is running (TRITON_INTERPRET=1, for tests without a GPU). Its dots
on bfloat16 operands are wrong, so operands are upcast to fp32 there; on a GPU they stay in the model
dtype with fp32 accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ladle.attention.metadata import AttentionMetadata
from ladle.attention.triton_decode import num_splits_for, split_kv_decode
from ladle.attention.triton_tile import LOG2E, attend_kv_tile


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per program (tokens x heads of one KV group)
    block_n: int  # context tokens per inner iteration
    num_warps: int
    num_stages: int


def default_tiles(head_dim: int, group: int, device: torch.device, max_query_len: int = 2) -> TileConfig:
    """64 x 64 tiles with head_dim <= 128 keep registers within an SM's budget (FlashAttention-2's choice for
    Hopper without warp specialisation); a tile must hold at least one token's whole head group. A
    decode-only step has one token per request, so a 64-row tile would be mostly padding: it gets the
    smallest tile a matrix multiply accepts (16 rows), and more programs stay in flight per SM."""
    rows = max(16, triton.next_power_of_2(group))
    if device.type != "cuda":
        # The interpreter runs every lane in numpy: small tiles keep the CPU tests fast.
        return TileConfig(rows, 16, 1, 1)
    if max_query_len == 1:
        return TileConfig(rows, 64 if head_dim <= 128 else 32, 4, 2)
    block_n = 64 if head_dim <= 128 else 32
    return TileConfig(max(64, rows), block_n, 4, 2 if head_dim > 64 else 3)


@triton.jit
def _write_kv_kernel(
    k, v, k_cache, v_cache, slot_mapping,
    stride_kt, stride_vt, stride_cs,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per token: its kvh x head_dim K and V rows go to pool slot slot_mapping[t]; a negative
    slot marks a padding token (as in vLLM) and is skipped, so padded CUDA-graph batches need no branch."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        kr = tl.load(k + t * stride_kt + offs, mask=mask)
        vr = tl.load(v + t * stride_vt + offs, mask=mask)
        tl.store(k_cache + slot * stride_cs + offs, kr.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + slot * stride_cs + offs, vr.to(v_cache.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, kvh, hd] into slots slot_mapping [T] of caches [num_blocks, block_size, kvh, hd]."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    kvh, hd = k_cache.shape[-2:]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool must be contiguous: a slot is addressed as one kvh x head_dim row")
    # Each token's kvh x hd values must be one dense row; projections produce that, but check cheaply.
    k = k if k.stride(-1) == 1 and k.stride(-2) == hd else k.contiguous()
    v = v if v.stride(-1) == 1 and v.stride(-2) == hd else v.contiguous()
    row = kvh * hd
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), row,
        ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4 if row >= 1024 else 1,
    )


@triton.jit
def _find_seq(cu_seqlens_q, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The request whose query tiles hold program pid. Request i's tiles start at cu[i] // BLOCK_Q + i:
    the + i leaves room for its partial last tile, so the grid size needs no device-to-host sync."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs and the block-table width change every step; Triton would otherwise compile a variant for each
# of "== 1", "multiple of 16" and "other" it meets, each costing seconds mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
    qk_scale, num_seqs, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_seqlens_q, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q < q_len:
        ctx = tl.load(context_lens + seq)
        offset = ctx - q_len  # tokens cached before this chunk: query token i sits at position offset + i

        rows = tl.arange(0, BLOCK_M)
        tok = tile * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
        pos = offset + tok
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM

        q_ptrs = q + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
        qt = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            qt = qt.to(tl.float32)

        # Finite start, so padding rows (no visible key) give exp2(-inf - m) = 0 instead of NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Keys up to the last query of this tile; causality inside the chunk is the pos mask below. With a
        # sliding window (0: none) a query at p sees keys (p - window, p], so the walk starts at the first
        # query's window, and keys before it are never loaded (their blocks may be given back).
        last = offset + tl.minimum((tile + 1) * BLOCK_Q, q_len)
        win = tl.where(window > 0, window, 1 << 30)
        first = tl.maximum(offset + tile * BLOCK_Q - win + 1, 0)
        table = block_tables + seq.to(tl.int64) * stride_bt
        for start in range(first // BLOCK_N * BLOCK_N, last, BLOCK_N):
            kn = start + tl.arange(0, BLOCK_N)
            k_ok = (kn < last) & (kn >= first)
            visible = k_ok[None, :] & (kn[None, :] <= pos[:, None]) & (kn[None, :] > pos[:, None] - win)
            m_i, l_i, acc = attend_kv_tile(qt, m_i, l_i, acc, k_cache, v_cache, table, kn, k_ok, visible, kv_head,
                                           d, d_ok, qk_scale, stride_cb, stride_cs, stride_ch, PAGE, UPCAST, PRECISION)

        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_i[:, None]
        o_ptrs = out + (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None, tiles: TileConfig | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] of this step's tokens, whose K/V are already in the pool -> output [T, H, D] in q's dtype.

    Request i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1], at positions context_lens[i] - q_len
    onwards, and attends causally to its first context_lens[i] tokens through block_tables[i] (with
    attn.sliding_window W, a query at p to keys (p - W, p] only).

    A decode-only step whose requests x KV heads would leave the GPU mostly idle splits each context into
    num_splits ranges (ladle.attention.triton_decode); None picks the count from the shapes (never on CPU),
    1 forces the single-pass kernel.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page, kvh, cache_hd = k_cache.shape
    if cache_hd != head_dim or num_heads % kvh:
        raise ValueError(f"q {tuple(q.shape)} does not match a KV pool of {kvh} heads x {cache_hd}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or attn.block_tables.stride(-1) != 1:
        raise ValueError("k and v pools must share one layout with a contiguous head_dim, and block-table "
                         "rows must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = attn.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = num_heads // kvh
    max_query_len = max(attn.query_lens)
    tiles = tiles or default_tiles(head_dim, group, q.device, max_query_len)
    if max_query_len == 1:
        splits = num_splits_for(num_seqs, kvh, q.device) if num_splits is None else num_splits
        if splits > 1:
            return split_kv_decode(q, k_cache, v_cache, attn, scale, splits, out, block_n=tiles.block_n,
                                   num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    window = attn.sliding_window or 0
    block_q = tiles.block_m // group
    upcast = q.device.type == "cpu" and q.dtype == torch.bfloat16  # CPU tensors: the interpreter is running
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    grid = (num_tokens // block_q + num_seqs, kvh)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, attn.cu_seqlens_q, attn.context_lens, attn.block_tables,
        scale * LOG2E, num_seqs, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), attn.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGE=page,
        BLOCK_M=tiles.block_m, BLOCK_Q=block_q, BLOCK_N=tiles.block_n,
        UPCAST=upcast, PRECISION=precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    attn: AttentionMetadata, scale: float, tiles: TileConfig | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """The same contract as ladle.attention.torch_ref.paged_attention: write this step's K/V, then attend."""
    write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
    return attention(q, k_cache, v_cache, attn, scale, tiles=tiles, num_splits=num_splits)
