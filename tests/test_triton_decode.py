"""The split-KV decode kernels (ladle.attention.triton_decode) against the torch reference.

As in test_triton_kernels.py: without a GPU the kernels run in Triton's interpreter on CPU tensors, so
TRITON_INTERPRET=1 is set before ladle's Triton modules are imported, and sizes are tiny. Split counts go
past the number of key tiles of the short contexts, so empty partitions are exercised, and every batch
carries a padding row (slot -1, context 0) as a CUDA-graph batch does.
"""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

pytest.importorskip("triton", reason="triton is not installed (the 'test' extra installs it)")

from typing import Any  # noqa: E402

from test_triton_kernels import TOLERANCE, Step  # noqa: E402

from ladle.attention import triton_attention as kernels  # noqa: E402
from ladle.attention import triton_decode  # noqa: E402
from ladle.attention.metadata import AttentionMetadata  # noqa: E402
from sm90 import compile_for_sm90  # noqa: E402

# Context lengths of the decodes: one token, either side of a page / key tile (16), and a long one.
CONTEXTS = (1, 15, 16, 17, 300)
PAD_AT = 2  # the padding row sits between real rows, so a stray write would show up in a neighbour


def pad_step(attn: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: int
             ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Insert a padding decode at row `at` of a decode-only step: slot -1 (no KV write), context 0, a block
    table of zeros, and a q row of large values that would leak into the output if it were ever read."""
    n = attn.num_seqs + 1

    def insert(x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:at], row[None].to(x.device, x.dtype), x[at:]])

    padded = AttentionMetadata(
        slot_mapping=insert(attn.slot_mapping, torch.tensor(-1)),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=attn.cu_seqlens_q.device),
        context_lens=insert(attn.context_lens, torch.tensor(0)),
        block_tables=insert(attn.block_tables, torch.zeros(attn.block_tables.shape[1], dtype=torch.int32)),
        query_lens=(1,) * n,
        context_lens_host=attn.context_lens_host[:at] + (0,) + attn.context_lens_host[at:],
        block_size=attn.block_size, sliding_window=attn.sliding_window,
    )
    return padded, insert(q, torch.full_like(q[0], 1e4)), insert(k, k[0]), insert(v, v[0])


def run_split(step: Step, num_splits: int) -> torch.Tensor:
    """The step, padded, through write_kv and the split kernels (even at one split, which attention() would
    send to the single-pass kernel); the padding row's output is checked here and dropped."""
    attn, q, k, v = pad_step(step.attn(DEVICE), *(x.to(DEVICE) for x in (step.q, step.k, step.v)), PAD_AT)
    kc, vc = step.k_cache.to(DEVICE, copy=True), step.v_cache.to(DEVICE, copy=True)
    kernels.write_kv(k, v, kc, vc, attn.slot_mapping)
    out = torch.full_like(q, float("nan"))  # every row must be written
    triton_decode.split_kv_decode(q, kc, vc, attn, step.scale, num_splits, out)
    out = out.cpu()
    assert torch.equal(out[PAD_AT], torch.zeros_like(out[PAD_AT])), "a padding row must give zeros"
    return torch.cat([out[:PAD_AT], out[PAD_AT + 1:]])


def decode_step(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int) -> Step:
    return Step([(c - 1, 1) for c in CONTEXTS], heads, kv_heads, dim, dtype, seed=seed)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("dim", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (10, 2)])
def test_split_decode_matches_reference_fp32(num_splits: int, dim: int, heads: int, kv_heads: int) -> None:
    step = decode_step(heads, kv_heads, dim, torch.float32, seed=num_splits + dim + heads)
    got = run_split(step, num_splits)
    torch.testing.assert_close(got, step.reference()[0], atol=TOLERANCE[torch.float32][0], rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 16, 40])
def test_split_decode_with_a_sliding_window(num_splits: int, window: int) -> None:
    """The splits share the window's keys (the last W of each context), not the whole context."""
    step = Step([(c - 1, 1) for c in CONTEXTS], 8, 2, 16, torch.float32, seed=window + num_splits, window=window)
    got = run_split(step, num_splits)
    torch.testing.assert_close(got, step.reference()[0], atol=TOLERANCE[torch.float32][0], rtol=0)


@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (10, 2)])
def test_split_decode_bf16(num_splits: int, heads: int, kv_heads: int) -> None:
    step = decode_step(heads, kv_heads, 32, torch.bfloat16, seed=num_splits + heads)
    got = run_split(step, num_splits)
    assert got.dtype == torch.bfloat16
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(got.float(), step.reference()[0], atol=atol, rtol=rtol)


def test_attention_dispatches_decode_steps_to_split_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """num_splits > 1 on a decode-only step takes the split path; automatic (None) on CPU and a forced 1 keep
    the single-pass kernel; a step with a prefill chunk never splits. All match the reference."""
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[5])  # num_splits
        return triton_decode.split_kv_decode(*args, **kwargs)

    monkeypatch.setattr(kernels, "split_kv_decode", counting)
    decode = Step([(c - 1, 1) for c in (40, 3)], 8, 2, 16, torch.float32, seed=1)
    mixed = Step([(0, 5), (39, 1)], 8, 2, 16, torch.float32, seed=2)
    for step, num_splits, want_calls in ((decode, 3, [3]), (decode, None, []), (decode, 1, []), (mixed, 4, [])):
        calls.clear()
        kc, vc = step.k_cache.to(DEVICE, copy=True), step.v_cache.to(DEVICE, copy=True)
        q, k, v = (x.to(DEVICE) for x in (step.q, step.k, step.v))
        out = kernels.paged_attention(q, k, v, kc, vc, step.attn(DEVICE), step.scale, num_splits=num_splits)
        if num_splits is not None or not ON_GPU:  # automatic on a GPU splits when the GPU is idle enough
            assert calls == want_calls
        torch.testing.assert_close(out.cpu(), step.reference()[0], atol=TOLERANCE[torch.float32][0], rtol=0)


def test_num_splits_for_depends_on_shapes_only() -> None:
    cpu = torch.device("cpu")
    assert triton_decode.num_splits_for(1, 8, cpu) == 1  # the CPU engine and tests keep the single pass
    if ON_GPU:
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        assert 1 < triton_decode.num_splits_for(1, 8, DEVICE) <= triton_decode.MAX_SPLITS
        assert triton_decode.num_splits_for(sms, 8, DEVICE) == 1


# Compiled for sm_90 by tests/sm90.py (prelude: imports and build()).
_COMPILE_FOR_SM90 = """
from ladle.attention import triton_decode as td

i32 = lambda *names: {n: "i32" for n in names}
print("triton", triton.__version__)
for dtype, group, prec in [("*bf16", 4, "tf32"), ("*bf16", 5, "tf32"), ("*fp32", 4, "ieee"), ("*fp32", 5, "ieee")]:
    ptrs = dict(q=dtype, k_cache=dtype, v_cache=dtype, part_out="*fp32", part_lse="*fp32", cu_seqlens_q="*i32",
                context_lens="*i32", block_tables="*i32", qk_scale="fp32")
    ints = i32("window", "stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_bt")
    consts = dict(GROUP=group, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_M=16, BLOCK_N=64, UPCAST=False,
                  PRECISION=prec)
    c = build(td._split_kv_decode_kernel, dict(ptrs, **ints), consts, num_warps=4, num_stages=2)
    if dtype == "*bf16":
        assert "mma" in c.asm["ptx"], "bf16 decode must use tensor cores"
    build(td._merge_kernel, dict(part_out="*fp32", part_lse="*fp32", out=dtype, cu_seqlens_q="*i32",
          **i32("num_splits", "stride_ot", "stride_oh")), dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64), num_warps=4)
print("compiled for sm_90")
"""


@pytest.mark.slow
def test_decode_kernels_compile_for_hopper() -> None:
    compile_for_sm90(_COMPILE_FOR_SM90)
