"""DeepSeek-V4 (sliding-window, compressed-sparse and heavily-compressed attention, hash and scored MoE,
hyper-connections) against HF transformers, token for token in fp32 on CPU: every step budget and chunk cap
(the compressors' pending groups and entries carried across chunks), preemption, a second pass."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hf_oracle import assert_greedy_under_preemption, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.demo import build_tokenizer

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
CONFIGS = [(b, c) for b in (1, 7, 64, 4096) for c in (None, 5, 19) if c is None or c <= b]
SW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# Window smaller than a block (16) with top-k below the entries of a long prompt; window larger than a block
# with top-k above them; compressed layers first, two hash layers and a YaRN compress rope.
MIXES = {
    "small_window": dict(layer_types=[SW, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=8,
                         index_topk=3),
    "wide_window": dict(layer_types=[CSA, SW, HCA, CSA], mlp_layer_types=["moe"] * 4, sliding_window=40,
                        index_topk=96, compress_rates={CSA: 4, HCA: 32}),
    "hca_first": dict(layer_types=[HCA, CSA, SW], mlp_layer_types=["hash_moe", "hash_moe", "moe"],
                      sliding_window=16, index_topk=5, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 1024}),
}


def build(path: Path, seed: int, **mix) -> torch.nn.Module:
    """A random DeepSeek-V4 checkpoint saved by HF itself (DeepSeek's tensor names), with the ChatML demo
    tokenizer. Eight indexer heads: an entry scores exactly 0 when every head's relu is 0, and among tied
    scores HF's topk picks arbitrarily where ladle picks the earliest, so few heads make ties (and
    disagreements that are no one's error) common. Weights are drawn wider than HF's init, so tokens are
    decisive and every part matters: sinks, gate biases, hyper-connection bases and scales, and a hash table
    of distinct experts."""
    import transformers

    kwargs = dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=4,
                  compress_rates={CSA: 4, HCA: 16}, hc_mult=2, hc_sinkhorn_iters=5, o_groups=2, o_lora_rank=16,
                  index_n_heads=8, index_head_dim=16, max_position_embeddings=40960, partial_rotary_factor=0.25)
    kwargs.update(mix)
    config = transformers.DeepseekV4Config(num_hidden_layers=len(mix["layer_types"]), **kwargs)
    config.architectures = ["DeepseekV4ForCausalLM"]
    torch.manual_seed(seed)
    hf = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "scale" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0, 0.5 if p.dim() == 1 else 0.15)
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], config.n_routed_experts).argsort(-1)[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    hf.save_pretrained(path)
    build_tokenizer(path, vocab_size=512)
    return hf


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        if len(tokens) == n:
            return tokens
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)


def prompts_of(lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """mix -> (checkpoint dir, HF model, prompts, HF's greedy tokens), each mix built once, when first asked."""
    built: dict[str, tuple] = {}

    def get(mix: str) -> tuple:
        if mix not in built:
            path = tmp_path_factory.mktemp(f"dsv4_{mix}")
            hf = build(path, 7, **MIXES[mix])
            # A few hundred tokens past 128 on the first mix; the others (every budget and cap too) stop at 150.
            prompts = prompts_of([1, 5, 19, 64, 150, 300] if mix == "small_window" else [1, 23, 150], 3)
            built[mix] = str(path), hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        return built[mix]

    return get


# One token a step is the slowest way through (the slow tier); every other budget and chunk runs fast.
RUNS = [pytest.param(mix, b, c, marks=pytest.mark.slow if b == 1 else ()) for mix in MIXES for b, c in CONFIGS]


@pytest.mark.parametrize("mix,budget,chunk", RUNS)
def test_greedy_equals_hf_for_every_budget_and_chunk(cases, mix, budget, chunk):
    path, _, prompts, want = cases(mix)
    kwargs = {"max_num_batched_tokens": budget} | ({"max_prefill_length": chunk} if chunk else {})
    llm = LLM(path, num_kv_blocks=256, **kwargs)
    assert ladle_tokens(llm, prompts, GREEDY) == want
    assert llm.stats.max_step_tokens <= budget
    assert ladle_tokens(llm, prompts, GREEDY) == want  # a second identical pass: no state left behind
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == 256 and not kv.state_slots


@pytest.mark.slow
@pytest.mark.parametrize("mix", list(MIXES))
def test_greedy_equals_hf_under_preemption(cases, mix):
    path, hf, _, _ = cases(mix)
    prompts = prompts_of([30] * 6, 12)
    want = [hf_greedy(hf, p, 60) for p in prompts]
    # Admission reserves a window's growth, not the compressed groups': their entries (one per 4 or 16-32
    # tokens) outgrow a block while decoding, and 10 blocks cannot hold all the requests admitted.
    assert_greedy_under_preemption(path, prompts, want, max_tokens=60, num_kv_blocks=10)


@pytest.mark.slow
def test_caches_are_a_shared_kv_window_and_a_compressor_slot_per_compressed_layer(cases):
    path = cases("small_window")[0]
    llm = LLM(path, num_kv_blocks=64, max_model_len=1024, max_num_batched_tokens=64)
    config = llm.engine.core.config
    report = config.report()
    assert "sliding window" in report and "key = value" in report
    assert "compressed_sparse_attention compressor state" in report
    cache = config.settings["enable_prefix_caching"]
    # Prefix caching stays on: hits resume from state checkpoints (tests/test_state_checkpoints.py).
    assert cache.value is True and config.num_state_checkpoints > 0 and "state checkpoints" in report
    # The window is paged and K=V: one tensor per layer, so a token costs head_dim floats in each layer.
    spec = config.kv_layout.groups[0].spec
    layers = len(MIXES["small_window"]["layer_types"])
    assert spec.kv_shared and config.plan.inputs.kv_bytes_per_token == layers * spec.head_dim * 4
    k, v = llm.engine.core.model_executor.runner.kv_caches[0]
    assert k is v
    # Entries are paged by entry position, one group per kind: CSA's (1 per 4 tokens), HCA's (1 per 16) and the
    # indexer's keys (half as wide: 32 to a block); the state slots hold only groups not complete yet, so a
    # longer context does not grow them.
    lines = config.kv_layout.lines()
    assert "compressed entries (1 per 4 tokens, 1x16 a block)" in lines[1]
    assert "compressed entries (1 per 16 tokens, 1x16 a block)" in lines[2]
    assert "compressed entries (1 per 4 tokens, 2x16 a block), 1 kv heads x 16" in lines[3]
    longer = LLM(path, num_kv_blocks=64, max_model_len=4096).engine.core.config.kv_layout
    assert longer.state_bytes_per_request == config.kv_layout.state_bytes_per_request
    core = llm.engine.core
    held: list[list[int]] = []
    core.before_execute = lambda sched: held.extend(
        [sum(b >= 0 for b in t) for t in core.kv.block_ids(s.request.request_id)] for s in sched.scheduled)
    ladle_tokens(llm, prompts_of([300], 4), SamplingParams(temperature=0, max_tokens=1))
    # 300 tokens: 75 CSA entries in 5 blocks, 18 HCA entries in 2, 75 keys in 3; the window (8 tokens) only
    # the blocks of a 64-token chunk and the 7 tokens before it.
    assert held[-1][1:] == [5, 2, 3] and max(h[0] for h in held) <= -(-(7 + 64) // 16) + 1
    explicit = LLM(path, num_kv_blocks=64, max_model_len=1024, enable_prefix_caching=True).engine.core.config
    assert explicit.settings["enable_prefix_caching"].source == "explicit" and explicit.num_state_checkpoints > 0


def test_ties_at_the_kth_score_go_to_the_earliest_entry():
    from ladle.models.deepseek_v4.compressor import _top_k_earliest

    scores = torch.tensor([[0.5, 0.0, 0.0, 0.0, -1.0, 0.0], [0.1, 0.2, float("-inf"), 0.3, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert [sorted(r) for r in _top_k_earliest(scores, 3).tolist()] == [[0, 1, 2], [0, 1, 3], [0, 1, 2]]
    rng = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 4, (64, 40), generator=rng).float()  # many ties at every rank
    want = ties.sort(dim=-1, descending=True, stable=True).indices[:, :9]
    assert torch.equal(_top_k_earliest(ties, 9).sort(dim=-1).values, want.sort(dim=-1).values)


@pytest.mark.slow
def test_seed_b_on_deepseek_v4_explicit_chunk_is_honoured_and_output_unchanged(tmp_path):
    """The second seed report's prompts on a tiny DeepSeek-V4 with its real compression rates (4 and 128):
    --max-prefill-length 8192 splits them 8192/8192/6541 and 8192 x4 + 2174 (each last chunk split once more at
    the prompt's last block boundary, where prefix caching checkpoints the state), the compressors' state
    carried across every split, and the tokens equal one pass over each whole prompt."""
    build(tmp_path, 3, layer_types=[CSA, HCA], mlp_layer_types=["hash_moe", "moe"], sliding_window=32,
          index_topk=16, compress_rates={CSA: 4, HCA: 128}, hidden_size=32, num_attention_heads=2, q_lora_rank=32,
          o_groups=1, max_position_embeddings=36000)
    prompts = [{"prompt_token_ids": p} for p in prompts_of([22925], 1) + prompts_of([34942], 2)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chunked = LLM(str(tmp_path), max_prefill_length=8192)
    assert chunked.config.settings["max_prefill_length"].source == "explicit"
    got = [chunked.generate(p, params, use_tqdm=False)[0] for p in prompts]  # one at a time, as in the report
    assert got[0].outputs[0].prefill_chunks == [8192, 8192, 6528, 13]
    assert got[1].outputs[0].prefill_chunks == [8192] * 4 + [2160, 14]
    single = LLM(str(tmp_path), max_num_batched_tokens=34944, max_prefill_length=34944, enable_prefix_caching=False)
    want = [single.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert want[1].outputs[0].prefill_chunks == [34942]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.slow
def test_the_plan_covers_the_indexer_and_refuses_a_chunk_that_does_not_fit(tmp_path):
    """The activation profile runs the real layers at the worst context, so the indexer's scores over every
    compressed entry are in it: a budget with room for a step of about 1,536 tokens derives such a chunk, a
    2,536-token prompt is split and its measured peak stays inside the budget, and an explicit single pass
    of it is refused with the largest chunk that fits."""
    from ladle.startup.memory import measure_peak

    build(tmp_path, 3, layer_types=[CSA, HCA], mlp_layer_types=["hash_moe", "moe"], sliding_window=32,
          index_topk=16, compress_rates={CSA: 4, HCA: 128}, max_position_embeddings=4096)
    # Without prefix caching: its state checkpoints take a share of the budget, and this is about the profile.
    inp = LLM(str(tmp_path), max_num_batched_tokens=64, enable_prefix_caching=False).config.plan.inputs
    budget = (inp.weights + 8 * 2**20 + inp.state_bytes + inp.request_blocks(4096, 1536) * inp.block_bytes
              + inp.activation.predict(1536, 4096))
    llm = LLM(str(tmp_path), memory_budget=budget, enable_prefix_caching=False)
    step = llm.config.max_num_batched_tokens
    assert llm.config.settings["max_num_batched_tokens"].source == "derived" and 1024 < step < 2048
    held = {t.data_ptr(): t for cache in llm.engine.core.model_executor.runner.kv_caches for t in cache}  # pool and state slots
    kv = sum(t.numel() * t.element_size() for t in held.values())
    outs: list = []
    prompt = {"prompt_token_ids": prompts_of([2536], 5)[0]}
    peak = measure_peak(lambda: outs.extend(llm.generate(prompt, GREEDY, use_tqdm=False)), torch.device("cpu"))
    assert outs[0].outputs[0].prefill_chunks == [step, 2536 - step]
    assert inp.weights + kv + peak < budget
    with pytest.raises(ValueError, match=r"max_prefill_length=2536 does not fit.*the largest max_prefill_length "
                                         r"that fits is 1\d\d\d"):
        LLM(str(tmp_path), memory_budget=budget, max_prefill_length=2536, enable_prefix_caching=False)
