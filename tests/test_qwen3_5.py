"""Qwen3.5 (Gated DeltaNet + gated full attention) against HF transformers, token for token in fp32 on CPU:
every step budget and chunk cap (the recurrent and conv state carried across chunks), preemption, failed
steps, and a state per request that does not grow with the prompt."""
from __future__ import annotations

import random

import pytest
import torch

from hf_oracle import assert_greedy_under_preemption, hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
CONFIGS = [(b, c) for b in (1, 7, 64, 4096) for c in (None, 5, 19) if c is None or c <= b]
# Layer mixes and head counts: GQA in both kinds of layer; odd head counts and head dims; a full layer first.
MIXES = {
    "gqa": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24),
    "odd": dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                             "linear_attention"],
                num_attention_heads=3, num_key_value_heads=1, head_dim=20, linear_num_key_heads=3,
                linear_num_value_heads=3, linear_key_head_dim=12, linear_value_head_dim=20, linear_conv_kernel_dim=3),
    "moe": dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
}


def _build(path, seed: int, **mix) -> object:
    """A random Qwen3.5 checkpoint (Qwen3.5-MoE when the mix has experts), saved by HF itself."""
    import transformers

    name = "Qwen3_5Moe" if "num_experts" in mix else "Qwen3_5"
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=96, max_position_embeddings=8192) | mix
    config = getattr(transformers, f"{name}TextConfig")(num_hidden_layers=len(mix["layer_types"]), **shape)
    config.architectures = [f"{name}ForCausalLM"]
    torch.manual_seed(seed)
    hf = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():  # HF's init is nearly uniform; larger weights give distinct, decisive tokens
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 0.5 if ("A_log" in name or "dt_bias" in name) else 0.15)
    hf.save_pretrained(path)
    return hf


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module", params=list(MIXES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
    hf = _build(path, 7, **MIXES[request.param])
    lens = [1, 5, 19, 64, 150, 600] if request.param == "gqa" else [1, 23, 130]
    prompts = _prompts(lens, 3)
    return str(path), hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("budget,chunk", [pytest.param(b, c, marks=pytest.mark.slow if b == 1 else ())
                                          for b, c in CONFIGS])  # one token a step: the slow tier
def test_greedy_equals_hf_for_every_budget_and_chunk(case, budget, chunk):
    path, _, prompts, want = case
    kwargs = {"max_num_batched_tokens": budget} | ({"max_prefill_length": chunk} if chunk else {})
    llm = LLM(path, num_kv_blocks=128, **kwargs)
    assert ladle_tokens(llm, prompts, GREEDY) == want
    assert llm.stats.max_step_tokens <= budget
    assert ladle_tokens(llm, prompts, GREEDY) == want  # a second identical pass: no state left behind by the first
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == 128 and not kv.state_slots


def test_greedy_equals_hf_under_preemption(case):
    path, hf, _, _ = case
    prompts = _prompts([40] * 6, 12)
    want = [hf_greedy(hf, p, 24) for p in prompts]
    # 40 + 24 tokens = 4 blocks per request in each full-attention group: 9 blocks hold about 2 of the 6.
    assert_greedy_under_preemption(path, prompts, want, max_tokens=24, num_kv_blocks=9)


def test_prefix_caching_keeps_state_checkpoints_and_graphs_are_derived_off(case):
    path = case[0]
    llm = LLM(path, num_kv_blocks=64, max_num_seqs=8)
    settings = llm.engine.core.config.settings
    assert settings["enable_prefix_caching"].value is True
    count = settings["num_state_checkpoints"]
    assert count.value == 32 and count.source == "derived" and "4 per running request" in count.reason
    report = llm.engine.core.config.report()
    assert "state group 0: gated deltanet state" in report and "state slots" in report
    assert "state checkpoints" in report and "32 x" in report
    graphs = settings["max_cudagraph_capture_size"]
    assert graphs.value == 0 and "run eagerly" in graphs.reason or llm.engine.core.config.device.type == "cpu"


def test_state_per_request_does_not_grow_with_the_prompt(tmp_path):
    """A 3000-token prompt: the linear-attention layers hold one fixed slot (the same tensors, never
    reallocated); only the full-attention layer holds blocks, one per 16 tokens."""
    path = tmp_path / "m"
    _build(path, 5, **MIXES["gqa"])
    llm = LLM(str(path), num_kv_blocks=256, max_num_batched_tokens=512, max_num_seqs=4)
    core = llm.engine.core
    layout = core.config.kv_layout
    linear = [i for g in layout.state_groups for i in g.layers]
    before = [(t.data_ptr(), tuple(t.shape)) for i in linear for t in core.model_executor.runner.kv_caches[i]]
    # One slot per running request, then the state checkpoints.
    slots = 4 + core.config.num_state_checkpoints
    assert [tuple(t.shape)[0] for i in linear for t in core.model_executor.runner.kv_caches[i]] == [slots] * 2 * len(linear)
    seen: list[tuple[int, int]] = []
    core.before_execute = lambda sched: seen.extend(
        (core.kv.held_blocks(s.request.request_id), len(core.kv.state_slots)) for s in sched.scheduled)
    ladle_tokens(llm, _prompts([3000], 9), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert max(b for b, _ in seen) == -(-3001 // 16) and {n for _, n in seen} == {1}
    assert [(t.data_ptr(), tuple(t.shape)) for i in linear for t in core.model_executor.runner.kv_caches[i]] == before
    # The plan's per-token bytes count the one full-attention layer; the state is per request.
    spec = layout.groups[0].spec
    assert core.config.plan.inputs.kv_bytes_per_token == 2 * spec.num_kv_heads * spec.head_dim * 4
    assert core.config.plan.inputs.state_bytes == 4 * layout.state_bytes_per_request
    assert core.config.plan.inputs.checkpoint_bytes == layout.state_bytes_per_request


def test_a_step_that_fails_after_its_state_advanced_ends_only_the_failing_request(case):
    """The poisoned request raises inside the model, after the first layers advanced every request's state:
    the others restart from their first token, a snapshot guards the retries, and their tokens are HF's."""
    path, _, prompts, want = case
    llm = LLM(path, num_kv_blocks=128, max_num_batched_tokens=64)
    model = llm.engine.core.model_executor.runner.model
    poison = 511
    current: list[torch.Tensor] = []

    def remember(_module, args) -> None:
        current[:] = [args[0]]

    model.register_forward_pre_hook(remember)
    mixer = model.model.layers[-1]
    original = mixer.forward

    def failing(*args, **kwargs):
        if bool((current[0] == poison).any()):
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    mixer.forward = failing
    bad = [7, poison, 9, 11]
    outs = llm.generate([{"prompt_token_ids": p} for p in [*prompts, bad]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:-1]] == want
    assert outs[-1].outputs[0].finish_reason == "error"
    assert llm.stats.state_restarts >= 1 and not llm.engine.core.step_executor.suspects
    assert llm.engine.core.kv.num_free_blocks == 128 and not llm.engine.core.kv.state_slots


def test_an_image_text_checkpoint_serves_its_text_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (the layout Qwen3.5 ships in): its text_config builds the
    model, `model.language_model.*` loads, the vision tower and an MTP head are left out; same greedy tokens
    as HF's image-text model on text input."""
    import transformers
    from safetensors.torch import load_file, save_file

    text = MIXES["gqa"] | dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                               max_position_embeddings=8192)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(5)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 0.5 if ("A_log" in name or "dt_bias" in name) else 0.15)
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in weights)
    save_file(weights | {"mtp.fc.weight": torch.ones(64, 128)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    prompts = _prompts([1, 23, 130], 9)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert ladle_tokens(LLM(str(tmp_path), max_num_batched_tokens=7), prompts, GREEDY) == want
