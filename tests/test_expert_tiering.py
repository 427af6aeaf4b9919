"""Tiered MoE experts (ladle.experts): with every strategy, backing and cache size down to one token's top-k,
greedy tokens equal the fully resident run's, token for token, for Qwen3-MoE, Qwen3.5-MoE and DeepSeek-V4 (and
their FP8 / MXFP4 release formats, the tier holding the quantized bytes), under chunked prefill, prefix hits
and preemption; the cache's counters say what it did."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hf_oracle import ladle_tokens
from ladle import LLM, SamplingParams
from ladle.demo import build_checkpoint
from ladle.testing.fp8_checkpoints import write_dsv4_release_checkpoint, write_fp8_checkpoint

NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
TOP_K = 2  # every test model routes a token to 2 experts
# (strategy, slots, backing, prefetch): the smallest cache a token's experts fit in, a larger one, each strategy,
# fetches on the step's thread and ahead on the fetch thread.
TIERS = [("offload", TOP_K, "mmap", True), ("offload", 5, "host", False), ("offload", 3, "host", True),
         ("hybrid", TOP_K, "host", True), ("hybrid", 3, "mmap", False), ("cpu", None, "mmap", None),
         ("cpu", None, "host", None)]


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(n)] for n in lens]


def _tier_kwargs(strategy: str, slots: int | None, backing: str, prefetch: bool | None) -> dict:
    return ({"moe_strategy": strategy, "moe_backing": backing} | ({"moe_cache_size": slots} if slots else {})
            | ({"moe_prefetch": prefetch} if prefetch is not None else {}))


def _qwen3_moe(tmp: Path) -> str:
    return build_checkpoint(tmp / "qwen3_moe", "qwen3_moe", vocab_size=512, hidden_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=TOP_K, norm_topk_prob=True,
                            mlp_only_layers=[1], decoder_sparse_step=1, max_position_embeddings=2048, seed=3)


def _qwen3_5_moe(tmp: Path) -> str:
    from test_qwen3_5 import MIXES, _build

    _build(tmp / "qwen3_5_moe", 7, **MIXES["moe"])
    return str(tmp / "qwen3_5_moe")


def _dsv4(tmp: Path) -> str:
    from test_deepseek_v4 import MIXES, build

    build(tmp / "dsv4", 7, **MIXES["small_window"])
    return str(tmp / "dsv4")


def _qwen3_moe_fp8(tmp: Path) -> str:
    from test_fp8 import MOE

    return write_fp8_checkpoint(build_checkpoint(tmp / "moe", "qwen3_moe", **MOE, seed=2), tmp / "moe_fp8")


def _dsv4_release(tmp: Path) -> str:
    from test_dsv4_release import SHAPE
    from test_deepseek_v4 import build

    build(tmp / "dsv4_src", 0, **SHAPE)
    return write_dsv4_release_checkpoint(tmp / "dsv4_src", tmp / "dsv4_release")


MODELS = {"qwen3_moe": _qwen3_moe, "qwen3_5_moe": _qwen3_5_moe, "dsv4": _dsv4, "qwen3_moe_fp8": _qwen3_moe_fp8,
          "dsv4_mxfp4": _dsv4_release}


@pytest.fixture(scope="module", params=list(MODELS))
def resident(request, tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, the fully resident run's greedy tokens)."""
    path = MODELS[request.param](tmp_path_factory.mktemp(request.param))
    prompts = _prompts([1, 9, 40, 130], 3)
    with LLM(path, num_kv_blocks=128) as llm:
        assert llm.stats.experts is None  # everything fits: nothing tiered by default
        return path, prompts, ladle_tokens(llm, prompts, GREEDY)


@pytest.mark.parametrize("strategy,slots,backing,prefetch", TIERS)
def test_tiered_greedy_equals_resident_under_chunked_prefill_and_prefix_hits(resident, strategy, slots, backing,
                                                                              prefetch):
    path, prompts, want = resident
    with LLM(path, num_kv_blocks=128, max_num_batched_tokens=7, max_prefill_length=5,
             **_tier_kwargs(strategy, slots, backing, prefetch)) as llm:
        assert ladle_tokens(llm, prompts, GREEDY) == want
        hits = llm.stats.prefix_cache_hits
        assert ladle_tokens(llm, prompts, GREEDY) == want and llm.stats.prefix_cache_hits > hits
        e = llm.stats.experts
        assert e.misses > 0
        if strategy == "cpu":
            assert e.hits == e.bytes_fetched == 0 and e.computed_in_place == e.misses
        elif strategy == "offload":
            assert e.computed_in_place == 0 and e.bytes_fetched > 0 and e.fetch_seconds > 0
        assert (e.prefetched > 0) == bool(prefetch)


@pytest.mark.parametrize("strategy,slots,backing,prefetch", [("offload", TOP_K, "mmap", True),
                                                             ("hybrid", 3, "host", False)])
def test_tiered_greedy_equals_resident_under_preemption(resident, strategy, slots, backing, prefetch):
    path, prompts, want = resident
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(path, num_kv_blocks=128) as llm:
        longer = ladle_tokens(llm, prompts[1:3] * 3, params)
    with LLM(path, max_num_batched_tokens=64, max_prefill_length=19, num_kv_blocks=9,
             **_tier_kwargs(strategy, slots, backing, prefetch)) as llm:
        assert ladle_tokens(llm, prompts[1:3] * 3, params) == longer
        assert llm.stats.num_preemptions > 0 and llm.engine.core.kv.num_free_blocks == 9


def _probe(path: str, budget: str, warm: str, **kwargs) -> dict:
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("rss_probe.py")), path, budget, warm,
                          json.dumps(kwargs)],
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_mmap_tier_keeps_the_process_under_a_budget_its_experts_exceed(tmp_path):
    """Experts of 192 MiB, a budget of 112 MiB: the plan derives a cache and reads the rest from the files; with
    a quarter of the experts cached the process's own memory stays under the budget, with the resident run's
    tokens. The resident run (no budget) holds more than the experts' bytes, so the measure sees them."""
    path = build_checkpoint(tmp_path / "big_moe", "qwen3_moe", vocab_size=512, hidden_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                            moe_intermediate_size=512, num_experts=64, num_experts_per_tok=TOP_K,
                            norm_topk_prob=True, max_position_embeddings=2048, seed=1)
    expert_bytes, budget = 2 * 64 * 3 * 256 * 512 * 4, 112 * 2**20
    warm = _qwen3_moe(tmp_path)
    resident, derived = _probe(path, "none", warm), _probe(path, f"{budget}", warm)
    tiered = _probe(path, f"{budget}", warm, moe_cache_fraction=0.25)
    assert resident["moe_cache_size"] == "off" and resident["growth"] > expert_bytes
    assert isinstance(derived["moe_cache_size"], int) and derived["moe_cache_size"] < 128
    assert tiered["growth"] < budget < expert_bytes
    assert tiered["tokens"] == derived["tokens"] == resident["tokens"]
