"""The Triton paged-attention and KV-write kernels against the torch reference (CPU, fp32).

Without a GPU the kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 must be set before
any kernel is decorated, so it is set before ladle's Triton module is imported. Sizes are tiny, because the
interpreter runs every lane in numpy. With a GPU the same tests run the compiled kernels on CUDA tensors.
Skipped only when triton itself cannot be imported.
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

from ladle.attention import torch_ref as reference  # noqa: E402
from ladle.attention import triton_attention as kernels  # noqa: E402
from ladle.attention.groups import reference_group  # noqa: E402
from ladle.attention.metadata import AttentionMetadata  # noqa: E402
from ladle.runner.inputs import build_step_inputs  # noqa: E402
from ladle.runner.step_batch import StepBatch  # noqa: E402
from sm90 import compile_for_sm90  # noqa: E402

PAGE = 16
NUM_BLOCKS = 40
# (atol, rtol): bf16 keeps 8 mantissa bits, the interpreter truncates where a GPU rounds, and on a GPU the
# softmax weights are rounded to the value dtype before their matrix multiply.
TOLERANCE = {torch.float32: (2e-5, 0.0), torch.float16: (4e-3, 2e-3), torch.bfloat16: (2e-2, 1.6e-2)}
# (tokens already cached, new tokens): a fresh prefill, chunks at offsets that straddle pages and query
# tiles, decodes at page edges and one at the very first token.
MIXED = [(0, 19), (21, 13), (16, 1), (0, 1), (47, 1), (5, 2), (31, 1)]


class Step:
    """A pool filled with garbage, one block table per request from shuffled blocks, and this step's q/k/v,
    all on the CPU; the kernels get copies on DEVICE."""

    def __init__(self, requests: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                 seed: int = 0, window: int | None = None) -> None:
        self.window = window
        g = torch.Generator().manual_seed(seed)
        self.k_cache, self.v_cache = ((3 * torch.randn(NUM_BLOCKS, PAGE, kv_heads, dim, generator=g)).to(dtype)
                                      for _ in range(2))
        free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.chunks = StepBatch()
        for start, n in requests:
            need = -(-(start + n) // PAGE)
            table, free = free[:need], free[need:]
            self.chunks.add([0] * n, start, table, True)
        t = sum(n for _, n in requests)
        self.q, self.k, self.v = (torch.randn(t, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        self.scale = dim**-0.5

    def attn(self, device: torch.device) -> AttentionMetadata:
        return build_step_inputs(self.chunks, PAGE, device, groups=(reference_group(self.window),)).attn

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The torch reference in fp32 on the same (already rounded) values: output and the pools after."""
        kc, vc = self.k_cache.float(), self.v_cache.float()
        out = reference.paged_attention(self.q.float(), self.k.float(), self.v.float(), kc, vc,
                                        self.attn(torch.device("cpu")), self.scale)
        return out, kc, vc

    def kernel(self, tiles: kernels.TileConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kc, vc = self.k_cache.to(DEVICE, copy=True), self.v_cache.to(DEVICE, copy=True)
        q, k, v = (x.to(DEVICE) for x in (self.q, self.k, self.v))
        out = kernels.paged_attention(q, k, v, kc, vc, self.attn(DEVICE), self.scale, tiles=tiles)
        return out.cpu(), kc.cpu(), vc.cpu()


@pytest.mark.parametrize("dim", [16, 32, 64])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (10, 2)])
def test_mixed_step_matches_reference_fp32(dim: int, heads: int, kv_heads: int) -> None:
    step = Step(MIXED, heads, kv_heads, dim, torch.float32, seed=dim + heads)
    expected, ref_k, ref_v = step.reference()
    out, k_cache, v_cache = step.kernel()
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the writes land in the same slots
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32][0], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_step_low_precision(dtype: torch.dtype) -> None:
    step = Step(MIXED, 8, 2, 32, dtype, seed=3)
    expected, ref_k, _ = step.reference()
    out, k_cache, _ = step.kernel()
    assert out.dtype == dtype
    assert torch.equal(k_cache.float(), ref_k)  # a copy of values already in the pool dtype is exact
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype][0], rtol=TOLERANCE[dtype][1])


@pytest.mark.parametrize(
    "tiles",
    [kernels.TileConfig(64, 32, 1, 1), kernels.TileConfig(32, 16, 1, 1)],
    ids=["gpu-like-64x32", "32x16"],
)
def test_larger_tiles_cross_pages(tiles: kernels.TileConfig) -> None:
    """Key tiles wider than a page read several blocks per iteration; query tiles hold several tokens."""
    step = Step([(0, 37), (40, 1), (9, 20), (70, 1)], 8, 2, 16, torch.float32, seed=7)
    torch.testing.assert_close(step.kernel(tiles)[0], step.reference()[0], atol=TOLERANCE[torch.float32][0], rtol=0)


@pytest.mark.parametrize("window", [1, 7, 16, 20])
def test_sliding_window_matches_reference(window: int) -> None:
    """Windows shorter than a chunk, a page and a key tile, and longer: the kernel walks only the keys each
    query's window reaches, masked to (p - W, p], as the torch reference does."""
    step = Step(MIXED + [(40, 20), (90, 1)], 8, 2, 16, torch.float32, seed=window, window=window)
    torch.testing.assert_close(step.kernel()[0], step.reference()[0], atol=TOLERANCE[torch.float32][0], rtol=0)
    tiles = kernels.TileConfig(64, 32, 1, 1)  # key tiles wider than a page: the walk starts mid-tile
    torch.testing.assert_close(step.kernel(tiles)[0], step.reference()[0], atol=TOLERANCE[torch.float32][0], rtol=0)


def test_decode_only_batch() -> None:
    step = Step([(c, 1) for c in (0, 15, 16, 33, 90, 4)], 8, 2, 32, torch.float32, seed=11)
    torch.testing.assert_close(step.kernel()[0], step.reference()[0], atol=TOLERANCE[torch.float32][0], rtol=0)


def test_write_kv_skips_negative_slots() -> None:
    """A negative slot is a padding token (CUDA-graph batches): nothing is written for it."""
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.zeros(4, PAGE, 2, 16, device=DEVICE), torch.zeros(4, PAGE, 2, 16, device=DEVICE)
    k, v = torch.randn(3, 2, 16, generator=g).to(DEVICE), torch.randn(3, 2, 16, generator=g).to(DEVICE)
    kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([17, -1, 63], device=DEVICE))
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[17], k[0]) and torch.equal(flat_k[63], k[2])
    assert torch.equal(flat_v[17], v[0]) and torch.equal(flat_v[63], v[2])
    assert int((flat_k.abs().sum((1, 2)) != 0).sum()) == 2


def tiny_qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config

    from ladle.models.qwen3 import Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.2)
    return Qwen3ForCausalLM(config).eval()


def pools(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(8, PAGE, 2, 16, device=device), torch.zeros(8, PAGE, 2, 16, device=device)) for _ in range(2)]


def run_steps(model: torch.nn.Module, caches: list, steps: list[StepBatch],
              backend: object = None) -> list[torch.Tensor]:
    device = caches[0][0].device
    logits = []
    with torch.inference_mode():
        for chunks in steps:
            inputs = build_step_inputs(chunks, PAGE, device,
                                       groups=(reference_group(backend=backend),) if backend else None)
            hidden = model(inputs.input_ids, inputs.positions, caches, inputs.attn)
            logits.append(model.compute_logits(hidden).cpu())
    return logits


A, B = list(range(3, 40)), list(range(50, 61))
TABLE_A, TABLE_B = [5, 1, 7], [2]


def prefill_steps() -> list[StepBatch]:
    return [StepBatch().add(A[:20], 0, TABLE_A, False),
            StepBatch().add(A[20:], 20, TABLE_A, True).add(B, 0, TABLE_B, True)]


def decodes() -> StepBatch:
    return StepBatch().add([9], 37, TABLE_A, True).add([4], 11, TABLE_B, True)


@pytest.mark.slow
def test_model_forward_with_triton_attention() -> None:
    """A tiny Qwen3 runs a chunked prefill and a mixed step with the Triton kernels (the Triton attention
    backend, and the fused norms, q/k-norm + rope and SiLU-and-mul of TritonOps) in place of the torch
    reference (on CPU); its logits match the reference path's."""
    from ladle.attention.triton_backend import TritonAttention
    from ladle.models.layers.ops import TritonOps, set_ops

    model = tiny_qwen3()
    steps = prefill_steps() + [decodes()]
    want = run_steps(model, pools(torch.device("cpu")), steps)
    got = run_steps(set_ops(model.to(DEVICE), TritonOps()), pools(DEVICE), steps, TritonAttention())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_decode_graph_buffers_pad_without_side_effects() -> None:
    """The CUDA-graph decode path (captured on a GPU, eager on CPU): two decodes padded to a batch of 4 give
    the logits of a plain step, and the padding rows neither write KV (slot -1) nor read it (context 0)."""
    from ladle.attention.triton_backend import TritonAttention
    from ladle.runner.cuda_graphs import DecodeGraphs

    backend = TritonAttention()
    model = tiny_qwen3().to(DEVICE)
    caches = pools(DEVICE)
    run_steps(model, caches, prefill_steps(), backend)
    want = run_steps(model, caches, [decodes()], backend)[0]
    before = [(k.clone(), v.clone()) for k, v in caches]
    graphs = DecodeGraphs(model, caches, PAGE, max_model_len=128, max_batch=4, device=DEVICE,
                          groups=(reference_group(backend=backend),))
    if ON_GPU:
        graphs.capture()
    assert graphs.sizes == (1, 2, 4) and graphs.bucket(3) == 4
    assert not graphs.can_run(StepBatch().add([1, 2], 0, [0], True))
    chunks = decodes().add([4], 12, TABLE_B, True)  # three rows, padded to four
    got = graphs.run(chunks)[:2].cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # a batch of 4 may pick other GEMM kernels
    written = build_step_inputs(chunks, PAGE).attn.slot_mapping
    for (k0, v0), (k1, v1) in zip(before, caches):
        for before_pool, after_pool in ((k0, k1), (v0, v1)):
            before_pool.view(-1, 2, 16)[written] = after_pool.view(-1, 2, 16)[written]
        assert torch.equal(k0, k1) and torch.equal(v0, v1)  # nothing else in the pool changed


# Compiled for sm_90 by tests/sm90.py (prelude: imports and build()).
_COMPILE_FOR_SM90 = """
from ladle.attention import triton_attention as ta

ptr = lambda t: dict(q=t, k_cache=t, v_cache=t, out=t, cu_seqlens_q="*i32", context_lens="*i32", block_tables="*i32")
ints = {n: "i32" for n in ("num_seqs", "window", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb",
                           "stride_cs", "stride_ch", "stride_bt")}
for dtype, group, dim, m, n, prec in [("*bf16", 4, 128, 64, 64, "tf32"), ("*bf16", 5, 128, 16, 64, "tf32"),
                                      ("*fp32", 4, 64, 64, 32, "ieee")]:
    consts = dict(GROUP=group, HEAD_DIM=dim, BLOCK_D=dim, PAGE=16, BLOCK_M=m, BLOCK_Q=m // group, BLOCK_N=n,
                  UPCAST=False, PRECISION=prec)
    c = build(ta._paged_attention_kernel, dict(ptr(dtype), qk_scale="fp32", **ints), consts, num_warps=4, num_stages=2)
    if dtype == "*bf16":
        assert "mma" in c.asm["ptx"], "bf16 attention must use tensor cores"
build(ta._write_kv_kernel, dict(k="*bf16", v="*bf16", k_cache="*bf16", v_cache="*bf16", slot_mapping="*i64",
      stride_kt="i32", stride_vt="i32", stride_cs="i32"), dict(ROW=1024, BLOCK=1024), num_warps=4)
print("compiled for sm_90")
"""


@pytest.mark.slow
def test_kernels_compile_for_hopper() -> None:
    compile_for_sm90(_COMPILE_FOR_SM90)
