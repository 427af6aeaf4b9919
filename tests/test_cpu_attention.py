"""The CPU attention backend: decode rows through ladle's C kernel, checked against the torch reference on
steps that mix prefill chunks and decodes, scattered block tables, windows, GQA, bf16 and odd head sizes;
and how the backend is chosen (explicit, derived, refused)."""
from __future__ import annotations

import pytest
import torch

from ladle.attention import torch_ref
from ladle.attention.cpu_attention import CpuAttention
from ladle.attention.metadata import AttentionMetadata
from ladle.attention.selector import resolve_backend, select_backend
from ladle.attention.torch_backend import TorchAttention
from ladle.kernels.cpu_isa import kernel_levels, resolve
from ladle.kernels.cpu_kernels import build, load
from ladle.kv_cache.specs import AttentionSpec

BLOCK = 16


def make_step(query_lens: list[int], contexts: list[int], heads: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype, window: int | None, seed: int = 0) -> tuple:
    """A step whose request i has contexts[i] tokens after it, query_lens[i] of them new, blocks scattered."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-c // BLOCK) for c in contexts]
    num_blocks = sum(widths) + 7
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(contexts), max(widths), dtype=torch.int32)
    used = 0
    for i, w in enumerate(widths):
        tables[i, :w] = order[used : used + w]
        used += w
    slots = []
    for i, (lq, ctx) in enumerate(zip(query_lens, contexts)):
        slots += [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(ctx - lq, ctx)]
    cu = [0]
    for lq in query_lens:
        cu.append(cu[-1] + lq)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32), block_tables=tables, query_lens=tuple(query_lens),
        context_lens_host=tuple(contexts), block_size=BLOCK, sliding_window=window)
    t = sum(query_lens)
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, k_cache, v_cache, attn


@pytest.fixture(scope="module", params=kernel_levels(), ids=lambda level: level.label)
def backend(request: pytest.FixtureRequest) -> CpuAttention:
    """The backend over each build of the kernels this CPU runs (its scalar, AVX2, AVX-512 paths)."""
    return CpuAttention(load(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 40)])
def test_matches_torch_reference(backend: CpuAttention, dtype: torch.dtype, window: int | None, heads: int,
                                 kv_heads: int, head_dim: int) -> None:
    # Decodes at contexts below, at and across the 8-row vector width and a block edge, beside two prefill
    # chunks (one continuing a request), so the split between the C kernel and torch is exercised too.
    query_lens = [1, 1, 5, 1, 1, 1, 20]
    contexts = [1, 7, 5, 16, 17, 203, 60]
    step = make_step(query_lens, contexts, heads, kv_heads, head_dim, dtype, window)
    caches = (step[3].clone(), step[4].clone())
    want = torch_ref.paged_attention(*step, scale=head_dim**-0.5)
    got = backend(step[0], step[1], step[2], *caches, step[5], head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # The new tokens' K and V were written to the pool, as the reference writes them.
    assert torch.equal(caches[0], step[3]) and torch.equal(caches[1], step[4])


def test_threads_do_not_change_the_result(backend: CpuAttention) -> None:
    step = make_step([1] * 6, [300, 31, 64, 1, 129, 90], 8, 4, 64, torch.float32, None, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend(*step, 0.125)
        torch.set_num_threads(2)
        two = backend(*step, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_build_is_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LADLE_KERNEL_CACHE_DIR", str(tmp_path))
    level = resolve()[0]
    first = build(level)
    stamp = first.stat().st_mtime_ns
    assert build(level) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


def test_backend_choice(tmp_path, monkeypatch) -> None:
    cpu, spec = torch.device("cpu"), AttentionSpec(4, 64, torch.float32)
    assert resolve_backend(cpu, None)[0] == "cpu"
    assert isinstance(select_backend(cpu, spec, "cpu"), CpuAttention)
    assert isinstance(select_backend(cpu, spec, "torch"), TorchAttention)
    # DeepSeek-V4's shared-KV groups keep the torch path.
    assert isinstance(select_backend(cpu, AttentionSpec(1, 64, torch.float32, kv_shared=True), "cpu"), TorchAttention)
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend(cpu, "triton")
    # Without a compiler (and nothing cached), auto falls back to torch and says why; an explicit cpu is refused.
    monkeypatch.setenv("LADLE_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    name, why = resolve_backend(cpu, None)
    assert name == "torch" and "no-such-cc" in why
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        resolve_backend(cpu, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1500])
def test_long_decodes_split_over_threads_match_the_reference(backend: CpuAttention, dtype: torch.dtype,
                                                             window: int | None) -> None:
    """Contexts past 1,024 tokens are attended in splits (work items of their own, merged through their maxima),
    so one long request's decode uses every thread; a split ends mid-block, one context is a whole multiple."""
    contexts = [1025, 3000, 2048, 40]
    step = make_step([1] * len(contexts), contexts, 8, 2, 64, dtype, window, seed=5)
    want = torch_ref.paged_attention(*step, scale=0.125)
    got = backend(*step, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_decode_gives_the_same_bits_in_any_batch(backend: CpuAttention) -> None:
    """The split of a request's context depends on it alone: beside other requests, or alone (where a short one
    is shared out by kv head), the same bits."""
    step = make_step([1, 1, 1], [3000, 700, 2100], 8, 4, 64, torch.float32, None, seed=6)
    together = backend(*step, 0.125)
    q, k, v, k_cache, v_cache, attn = step
    for i in range(3):
        alone = AttentionMetadata(
            slot_mapping=attn.slot_mapping[i:i + 1], cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
            context_lens=attn.context_lens[i:i + 1], block_tables=attn.block_tables[i:i + 1], query_lens=(1,),
            context_lens_host=attn.context_lens_host[i:i + 1], block_size=BLOCK, sliding_window=None)
        assert torch.equal(backend(q[i:i + 1], k[i:i + 1], v[i:i + 1], k_cache, v_cache, alone, 0.125), together[i:i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_kv_write_equals_index_copy_and_refuses_a_slot_outside_the_pool(backend: CpuAttention,
                                                                              dtype: torch.dtype) -> None:
    """The step's K/V rows, as the qkv projection's strided views, land where write_kv puts them; a slot past
    the pool raises before anything is written."""
    k_cache, v_cache = torch.zeros(6, BLOCK, 2, 8, dtype=dtype), torch.zeros(6, BLOCK, 2, 8, dtype=dtype)
    qkv = torch.randn(3, 64).to(dtype)
    k, v = qkv[:, 32:48].view(3, 2, 8), qkv[:, 48:].view(3, 2, 8)
    slots = torch.tensor([5, 17, 6 * BLOCK - 1])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    torch_ref.write_kv(k, v, want_k, want_v, slots)
    backend._write(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    before = k_cache.clone()
    with pytest.raises(IndexError, match="outside the pool"):
        backend._write(k, v, k_cache, v_cache, torch.tensor([1, 6 * BLOCK, 2]))
    assert torch.equal(k_cache, before)
