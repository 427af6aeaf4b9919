"""ladle's Qwen3/Llama models and paged attention against HF transformers (fp32, CPU, tiny random models)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from ladle.kv_cache.specs import AttentionSpec
from ladle.models.loading.loader import load_model
from ladle.models.registry import model_class_for
from ladle.attention.torch_ref import paged_attention, write_kv
from ladle.runner.inputs import build_step_inputs
from ladle.runner.step_batch import StepBatch

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96
SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # Larger than HF's 0.02 so attention is far from uniform and rope/masking errors show in the logits.
    initializer_range=0.2,
    dtype="float32",
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the tiny head_dim has frequencies in all three llama3 bands (kept, smoothed, divided).
    "original_max_position_embeddings": 32,
}
CONFIGS = {
    "qwen3-tied": lambda: Qwen3Config(**SMALL, tie_word_embeddings=True),
    "qwen3-untied-bias": lambda: Qwen3Config(**SMALL, tie_word_embeddings=False, attention_bias=True),
    "llama3-sharded-untied": lambda: LlamaConfig(
        **SMALL, tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_parameters=dict(LLAMA3_ROPE)
    ),
    "llama2-tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
}


class Pair:
    """An HF reference model and the ladle model loaded from its saved checkpoint."""

    def __init__(self, name: str, root: Path) -> None:
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="sdpa").eval()
        with torch.no_grad():  # norm weights and biases start at 1 / 0; perturb them so loading them is checked
            for p in hf.parameters():
                if p.dim() == 1:
                    p.add_(0.2 * torch.randn_like(p))
        path = root / name
        hf.save_pretrained(path, max_shard_size="40KB" if "sharded" in name else "1GB")
        self.hf = hf
        self.path = path
        self.model, self.config = load_model(str(path), torch.device("cpu"), torch.float32)

    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float()

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        specs = self.model.cache_specs(torch.float32)
        return [(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, s.num_kv_heads, s.head_dim),
                 torch.zeros(NUM_BLOCKS, BLOCK_SIZE, s.num_kv_heads, s.head_dim)) for s in specs]

    def step(self, step: StepBatch, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run one step and return the logits of every row."""
        inputs = build_step_inputs(step, BLOCK_SIZE)
        with torch.inference_mode():
            hidden = self.model(inputs.input_ids, inputs.positions, caches, inputs.attn)
            return self.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return Pair(request.param, tmp_path_factory.mktemp("models"))


class Blocks:
    """Hands out block ids from a shuffled pool, so block tables are never contiguous."""

    def __init__(self, seed: int = 0) -> None:
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()

    def take(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // BLOCK_SIZE)
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_and_checkpoint_shape(pair: Pair) -> None:
    files = {p.name for p in pair.path.iterdir()}
    assert ("model.safetensors.index.json" in files) == ("sharded" in pair.path.name)
    assert pair.model.cache_specs(torch.float32) == [AttentionSpec(2, 16, torch.float32)] * 2
    assert (pair.model.lm_head is None) == pair.config.tie_word_embeddings
    if "llama3" in pair.path.name:  # the scaled table really differs from plain rope
        plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
        assert not torch.allclose(pair.model.model.rotary_emb.inv_freq, plain)
    torch.testing.assert_close(pair.model.model.rotary_emb.inv_freq, pair.hf.model.rotary_emb.inv_freq)


def test_full_prefill_single(pair: Pair) -> None:
    ids = prompt(23, seed=1)
    logits = pair.step(StepBatch().add(ids, 0, Blocks().take(len(ids)), True), pair.caches())
    torch.testing.assert_close(logits, pair.hf_logits(ids), atol=ATOL, rtol=0)


def test_full_prefill_batch_of_three(pair: Pair) -> None:
    prompts = [prompt(9, seed=2), prompt(17, seed=3), prompt(4, seed=4)]
    blocks = Blocks(seed=1)
    step = StepBatch()
    for p in prompts:
        step.add(p, 0, blocks.take(len(p)), True)
    logits = pair.step(step, pair.caches())
    row = 0
    for p in prompts:
        torch.testing.assert_close(logits[row : row + len(p)], pair.hf_logits(p), atol=ATOL, rtol=0)
        row += len(p)


def test_chunked_prefill_matches_full(pair: Pair) -> None:
    ids = prompt(30, seed=5)
    expected = pair.hf_logits(ids)
    table = Blocks(seed=2).take(len(ids))
    caches = pair.caches()
    start = 0
    for size in (5, 1, 7, 3, 8, 6):
        chunk = StepBatch().add(ids[start : start + size], start, table, start + size == len(ids))
        logits = pair.step(chunk, caches)
        torch.testing.assert_close(logits, expected[start : start + size], atol=ATOL, rtol=0)
        start += size
    assert start == len(ids)
    torch.testing.assert_close(logits[-1], expected[-1], atol=ATOL, rtol=0)


def test_mixed_decode_and_prefill_step(pair: Pair) -> None:
    a, b, c = prompt(41, seed=6), prompt(15, seed=7), prompt(13, seed=8)
    blocks = Blocks(seed=3)
    ta, tb, tc = blocks.take(len(a)), blocks.take(len(b)), blocks.take(len(c))
    caches = pair.caches()
    # Step 1: prefill a[:39] and c[:12]. Step 2: a and c decode one token each while b prefills 6 tokens.
    # Step 3: a decodes again while b finishes its prompt.
    pair.step(StepBatch().add(a[:39], 0, ta, True).add(c[:12], 0, tc, True), caches)
    step2 = StepBatch().add([a[39]], 39, ta, True).add(b[:6], 0, tb, False).add([c[12]], 12, tc, True)
    logits = pair.step(step2, caches)
    full_a, full_b, full_c = pair.hf_logits(a), pair.hf_logits(b), pair.hf_logits(c)
    torch.testing.assert_close(logits[0], full_a[39], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1:7], full_b[:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[7], full_c[12], atol=ATOL, rtol=0)
    logits = pair.step(StepBatch().add(b[6:], 6, tb, True).add([a[40]], 40, ta, True), caches)
    torch.testing.assert_close(logits[:9], full_b[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[9], full_a[40], atol=ATOL, rtol=0)


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, D] at the last Lq positions of k, v [ctx, kvh, D]; naive causal softmax attention in fp64."""
    lq, h, _ = q.shape
    ctx, kvh, _ = k.shape
    k, v = k.repeat_interleave(h // kvh, dim=1).double(), v.repeat_interleave(h // kvh, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos = torch.arange(ctx - lq, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("tile,group_tokens", [(2048, 16384), (4, 8), (5, 16), (16, 1)])
def test_paged_attention_matches_dense_reference(tile: int, group_tokens: int) -> None:
    """Also with tiny context tiles and decode groups, so tile merging and tile edges are exercised."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, scale = 6, 2, 8, 0.3
    # (tokens already cached, new tokens): full prefills, offset chunks, and decodes of very different lengths
    # (so the decodes split into more than one padded group), including a one-token prompt.
    requests = [(0, 7), (10, 5), (20, 1), (3, 1), (61, 1), (0, 1), (33, 1), (2, 9)]
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim, generator=g)  # garbage outside written slots
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim, generator=g)
    blocks = Blocks(seed=4)
    chunks, history = StepBatch(), []
    for start, n in requests:
        table = blocks.take(start + n)
        hk, hv = torch.randn(start, kv_heads, dim, generator=g), torch.randn(start, kv_heads, dim, generator=g)
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start)])
        write_kv(hk, hv, k_cache, v_cache, slots.long())
        chunks.add([0] * n, start, table, True)
        history.append((hk, hv))
    inputs = build_step_inputs(chunks, BLOCK_SIZE)
    t = inputs.num_tokens
    q = torch.randn(t, heads, dim, generator=g)
    k, v = torch.randn(t, kv_heads, dim, generator=g), torch.randn(t, kv_heads, dim, generator=g)
    out = paged_attention(q, k, v, k_cache, v_cache, inputs.attn, scale, tile, group_tokens)
    assert out.shape == (t, heads, dim) and out.dtype == q.dtype
    row = 0
    for (start, n), (hk, hv) in zip(requests, history):
        rows = slice(row, row + n)
        ref = dense_reference(q[rows], torch.cat([hk, k[rows]]), torch.cat([hv, v[rows]]), scale)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=0)
        row += n


def test_unknown_architecture_is_rejected() -> None:
    config = LlamaConfig(**SMALL)
    config.architectures = ["MambaForCausalLM"]
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        model_class_for(config)


def test_missing_weight_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen3Config(**SMALL, tie_word_embeddings=True))
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="k_norm"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
