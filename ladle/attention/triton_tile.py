"""The inner step both Triton attention kernels share: one key tile of one request, read through its block
table, folded into a running (online) softmax. Triton inlines it into each kernel."""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels work in exp2: scores are pre-scaled by log2(e)


@triton.jit
def attend_kv_tile(
    qt, m_i, l_i, acc, k_cache, v_cache, table, kn, k_ok, visible, kv_head, d, d_ok,
    qk_scale, stride_cb, stride_cs, stride_ch,
    PAGE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step (exp2 domain) of a query tile over the keys kn of one request: K and V are
    read through its block table; visible [rows, keys] masks what each row may see. Returns the updated
    (row max, row sum, unnormalised output). Shared by the paged kernel and the split-KV decode kernel."""
    block = tl.load(table + kn // PAGE, mask=k_ok, other=0).to(tl.int64)
    slot = block * stride_cb + (kn % PAGE) * stride_cs + kv_head * stride_ch
    kt = tl.load(k_cache + slot[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    vt = tl.load(v_cache + slot[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    s = tl.dot(qt, kt, input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
    return m_new, l_i, acc
