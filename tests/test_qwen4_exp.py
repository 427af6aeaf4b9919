"""Qwen4-Exp (Gated DeltaNet + QSA indexed attention, MoE, hyper-connections, PLE) against HF transformers, token
for token in fp32 on CPU: every step budget and chunk cap (the QSA selection over blocks completed across chunks,
PLE's n-gram context and short-conv inputs carried in the state slot), batches, preemption, prefix-cache hits,
the image-text layout, and config fields refused by name."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from hf_oracle import assert_greedy_under_preemption, hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.demo import build_tokenizer

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
EOS = 2
_BASE = dict(vocab_size=512, hidden_size=64, max_position_embeddings=512, eos_token_id=EOS, num_experts=4,
             moe_intermediate_size=32, shared_expert_intermediate_size=48, ngram_vocab_size_base=200,
             make_ngram_vocab_size_divisible_by=8, hc_lowrank=16, indexer_kv_heads=1)
# Two layer mixes: QSA blocks of 4 with 2 kept, or blocks of 3 with 2 kept; PLE on some linear layers (n-grams up
# to 3, or bigrams only); GQA and MQA; 2 or 3 hyper-connection streams; silu or sigmoid output gates.
MIXES = {
    "gqa": dict(layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts_per_tok=2,
                hc_count=2, ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2,
                split_ngram_parts=2, indexer_n_heads=2, indexer_head_dim=16, indexer_budget=8,
                indexer_compress_ratio=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5}),
    "mqa": dict(layer_types=["indexed_attention", "linear_attention", "linear_attention", "indexed_attention",
                             "linear_attention"],
                num_attention_heads=3, num_key_value_heads=1, head_dim=20, linear_num_key_heads=3,
                linear_num_value_heads=3, linear_key_head_dim=12, linear_value_head_dim=20, linear_conv_kernel_dim=3,
                num_experts_per_tok=1, hc_count=3, ple_layer_ids=[3], ple_embed_dim=24, ngram_size=2,
                heads_per_ngram=3, ple_conv_kernel_size=3, split_ngram_parts=1, indexer_n_heads=3,
                indexer_head_dim=20, indexer_budget=6, indexer_compress_ratio=3, output_gate_type="sigmoid",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.8}),
}
CONFIGS = [(256, None), (64, 5), (48, 19), (7, None)]


def _scale(model) -> None:
    """HF's init is nearly uniform; larger weights give distinct, decisive tokens."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 0.5 if ("A_log" in name or "dt_bias" in name) else 0.15)


def _build(path, seed: int, **mix) -> object:
    import transformers

    config = transformers.Qwen4ExpTextConfig(num_hidden_layers=len(mix["layer_types"]), **(_BASE | mix))
    config.architectures = ["Qwen4ExpForCausalLM"]
    torch.manual_seed(seed)
    hf = transformers.Qwen4ExpForCausalLM(config).eval()
    _scale(hf)
    hf.save_pretrained(path)
    build_tokenizer(path, vocab_size=512)
    return hf


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    """Random prompts with an EOS inside the longer ones (PLE's n-gram shifts stop at it)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lens]
    for p in prompts:
        for j in range(10, len(p), 37):
            p[j] = EOS
    return prompts


@pytest.fixture(scope="module", params=list(MIXES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen4_exp_{request.param}")
    hf = _build(path, 7, **MIXES[request.param])
    # Longer than a few blocks and than the budget: the indexer drops blocks.
    prompts = _prompts([1, 5, 19, 45, 100], 3)
    return str(path), hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("budget,chunk", CONFIGS)
def test_greedy_equals_hf_for_every_budget_and_chunk(case, budget, chunk):
    path, _, prompts, want = case
    kwargs = {"max_num_batched_tokens": budget} | ({"max_prefill_length": chunk} if chunk else {})
    llm = LLM(path, num_kv_blocks=128, **kwargs)
    assert ladle_tokens(llm, prompts, GREEDY) == want
    assert llm.stats.max_step_tokens <= budget
    # A second pass: the prefix cache serves the prompts' blocks and state checkpoints; same tokens.
    assert llm.engine.core.config.settings["enable_prefix_caching"].value is True
    assert ladle_tokens(llm, prompts, GREEDY) == want
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == 128 and not kv.state_slots


def test_a_shared_prefix_is_served_from_the_cache_with_hf_tokens(case):
    path, hf, prompts, _ = case
    base = prompts[-1]
    second = [base[:64] + [5, 6, 7, 8, 9], base[:80] + [EOS, 11]]
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in second]
    llm = LLM(path, num_kv_blocks=128, max_num_batched_tokens=64, max_prefill_length=19)
    assert ladle_tokens(llm, [base], GREEDY) == [hf_greedy(hf, base, NEW_TOKENS)]
    outs = llm.generate([{"prompt_token_ids": p} for p in second], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens >= 48 for o in outs)


def test_greedy_equals_hf_under_preemption(case):
    path, hf, _, _ = case
    prompts = _prompts([40] * 6, 12)
    want = [hf_greedy(hf, p, 24) for p in prompts]
    # Two 64-token requests must not fit: 4 K/V blocks each, and 1 (gqa: 64 keys a block) or 2 (mqa: 32) of keys.
    assert_greedy_under_preemption(path, prompts, want, max_tokens=24, num_kv_blocks=9 if "gqa" in path else 11)


def test_the_cache_layout_pages_the_indexer_keys_at_their_size_and_keeps_ple_state(case):
    path = case[0]
    llm = LLM(path, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    layout = llm.engine.core.config.kv_layout
    mix = MIXES["gqa" if "gqa" in path else "mqa"]
    types = mix["layer_types"]
    indexed = [i for i, t in enumerate(types) if t == "indexed_attention"]
    # the attention layers, then one indexer-key layer per indexed layer, in a group of their own
    assert [g.layers for g in layout.groups] == [tuple(indexed), tuple(range(len(types), len(types) + len(indexed)))]
    keys = layout.groups[1].spec
    # as many keys to a page as their halves fit a K and a V row: gqa 2 x 16 values a row, keys of 16 -> 4 a row;
    # mqa 20 a row, keys of 20 -> 2
    assert (keys.block_scale, keys.head_dim) == ((4, 8) if "gqa" in path else (2, 10))
    assert keys.page_bytes(16) == layout.groups[0].spec.page_bytes(16)
    ple = [i - 1 for i in mix["ple_layer_ids"]]
    states = {g.spec.kind: g.layers for g in layout.state_groups}
    assert states["gated deltanet + PLE state"] == tuple(ple)
    report = llm.engine.core.config.report()
    assert "gated deltanet + PLE state" in report and "int64" in report


def test_an_image_text_checkpoint_serves_its_text_model_and_says_the_vision_tower_is_not_loaded(tmp_path, caplog):
    import transformers
    from safetensors.torch import load_file

    text = _BASE | MIXES["gqa"] | dict(num_hidden_layers=4)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    config = transformers.Qwen4ExpConfig(text_config=text, vision_config=vision)
    torch.manual_seed(5)
    hf = transformers.Qwen4ExpForConditionalGeneration(config).eval()
    _scale(hf)
    hf.save_pretrained(tmp_path)
    build_tokenizer(tmp_path, vocab_size=512)
    assert any(n.startswith("model.visual.") for n in load_file(tmp_path / "model.safetensors"))
    prompts = _prompts([1, 23, 60], 9)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    with caplog.at_level(logging.INFO, logger="ladle"):
        llm = LLM(str(tmp_path), max_num_batched_tokens=7)
    assert "the vision tower (model.visual.*) is not loaded" in caplog.text
    assert ladle_tokens(llm, prompts, GREEDY) == want


@pytest.mark.parametrize("fields,named", [
    ({"mystery_feature": 1}, "mystery_feature"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
    ({"hidden_act": "gelu", "output_gate_type": "silu"}, "hidden_act"),
])
def test_unsupported_config_fields_are_refused_by_name(case, tmp_path, fields, named):
    import json
    import shutil

    shutil.copytree(case[0], tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(fields)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        LLM(str(tmp_path / "m"))


def test_ngram_speculative_decoding_keeps_the_plain_tokens(case):
    """Drafts of single-token lookups (rarely right with random weights) are rejected, and the state slots (Gated
    DeltaNet's and PLE's) roll back to the row's first token; the tokens equal the plain run's."""
    from test_spec_decode import drafting, spec

    path = case[0]
    rng = random.Random(2)
    heads = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    texts = [h + t for h, t in zip(heads, ladle_tokens(LLM(path, max_num_batched_tokens=64), heads, params))]
    prompts, want = [t[:52] for t in texts], [t[52:84] for t in texts]
    long = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = drafting(LLM(path, max_num_batched_tokens=64, max_prefill_length=19,
                       speculative_config=spec(3, prompt_lookup_min=1)))
    assert ladle_tokens(llm, prompts, long) == want
    assert llm.stats.spec_decode_num_draft_tokens > 0


def test_ple_keeps_its_state_after_each_draft_for_a_rollback(case):
    """A row of a token and three drafts: PLE's output, and its state kept after each of the first tokens (the
    rows a rollback takes back), equal feeding the tokens one at a time."""
    from ladle.attention.metadata import StateMetadata
    from ladle.models.qwen4_exp.ple import PleLayer, ple_state_shapes

    config = case[1].config
    torch.manual_seed(0)
    layer = PleLayer(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    (conv, ctx), width = ple_state_shapes(config), config.hc_count * config.hidden_size

    def meta(n: int, first: bool, drafts: tuple[int, ...] = ()) -> StateMetadata:
        cu = torch.tensor([0, n])
        return StateMetadata(torch.tensor([0]), (0,), cu, cu, (0, n), (not first,),
                             (drafts,) if drafts else None)

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(6, *conv), torch.zeros(6, *ctx, dtype=torch.long)

    prompt, row = torch.tensor([7, EOS, 9, 11, 13]), torch.tensor([15, EOS, 17, 19])
    streams = torch.randn(9, width)
    with torch.no_grad():
        one, drafted = fresh(), fresh()
        for state in (one, drafted):
            layer(streams[:5], prompt, state, meta(5, True))
        want, kept = [], []
        for j in range(4):
            want.append(layer(streams[5 + j : 6 + j], row[j : j + 1], one, meta(1, False)))
            kept.append((one[0][0].clone(), one[1][0].clone()))
        got = layer(streams[5:], row, drafted, meta(4, False, (3, 4, 5)))
    close = dict(rtol=1e-5, atol=1e-6)  # four rows in one matmul against one at a time: rounding apart
    torch.testing.assert_close(got, torch.cat(want), **close)
    for j, slot in enumerate((3, 4, 5)):
        torch.testing.assert_close(drafted[0][slot], kept[j][0], **close)
        assert torch.equal(drafted[1][slot], kept[j][1])
    torch.testing.assert_close(drafted[0][0], one[0][0], **close)
    assert torch.equal(drafted[1][0], one[1][0])
    assert drafted[1][3].tolist() == [*prompt[-(ctx[0] - 1):].tolist(), 15][-ctx[0]:]


def test_a_config_hfs_own_checks_refuse_is_a_clear_error(tmp_path):
    """HF validates some configs itself (a strict dataclass error, not a ValueError): ladle says which file."""
    import json

    from ladle import LLM

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForCausalLM"],
                                                      "model_type": "qwen4_exp_text", "indexer_kv_heads": 2,
                                                      "indexer_n_heads": 3}))
    with pytest.raises(ValueError, match="cannot read the config"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("where", ["host", "mmap"])
def test_ple_tables_held_off_the_device_give_hf_tokens(case, where):
    """ple_table host: each step's rows gathered from the tables in host memory (on CPU the same memory, the same
    gather as on a GPU), staged before the first layer; mmap: the tables left in the checkpoint's files, mapped, no
    table-sized storage allocated, each step's rows read from the file. HF's tokens under the chunk cap, and from
    the prefix cache."""
    from ladle.models.layers.host_table import HostTable

    path, _, prompts, want = case
    llm = LLM(path, num_kv_blocks=128, max_num_batched_tokens=48, max_prefill_length=19, ple_table=where)
    tables = [m for m in llm.engine.core.model_executor.runner.model.modules() if isinstance(m, HostTable)]
    assert tables and all(t.on_host for t in tables)
    settings = llm.engine.core.config.settings
    assert settings["ple_table"].value == where and settings["ple_table"].source == "explicit"
    line = next(x for x in llm.engine.core.config.report().splitlines() if "PLE n-gram tables" in x)
    if where == "host":
        assert f"in {len(tables)} layers, in host memory (counted in the weights: on CPU it is the device's)" in line
    else:
        assert f"in {len(tables)} layers, in the checkpoint's files, mapped, not in the weights" in line
        maps = [line.split() for line in open("/proc/self/maps") if line.rstrip().endswith(".safetensors")]
        mapped = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps]
        for t in tables:  # an empty stand-in for the weight, the rows in segments mapped from the checkpoint's files
            assert t.weight.numel() == 0 and t.segments
            assert all(any(lo <= p.data_ptr() < hi for lo, hi in mapped) for _, p in t.segments)
    assert ladle_tokens(llm, prompts, GREEDY) == want
    assert ladle_tokens(llm, prompts, GREEDY) == want


def test_ple_table_mmap_needs_the_checkpoints_files(case):
    path, _, _, _ = case
    with pytest.raises(ValueError, match="ple_table=mmap reads the n-gram tables from the checkpoint's files"):
        LLM(path, ple_table="mmap", load_format="dummy")


def test_ple_table_is_refused_for_a_model_without_one(tmp_path):
    from ladle.demo import build_checkpoint

    path = build_checkpoint(tmp_path / "q3", "qwen3", vocab_size=512, hidden_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, seed=1)
    with pytest.raises(ValueError, match="ple_table is set, but this model has no PLE n-gram table"):
        LLM(path, ple_table="host")


@pytest.mark.parametrize("tier", [dict(moe_strategy="offload", moe_backing="mmap", moe_prefetch=True),
                                  dict(moe_strategy="hybrid", moe_backing="host", moe_prefetch=False),
                                  dict(moe_strategy="cpu", moe_backing="mmap")])
def test_tiered_experts_give_the_plain_runs_tokens(case, tier):
    """The routed experts cached in as few device slots as a token routes to (or computed where they live):
    the plain run's tokens (HF's) under the chunk cap, and again from the prefix cache."""
    path, hf, prompts, want = case
    slots = {} if tier["moe_strategy"] == "cpu" else {"moe_cache_size": hf.config.num_experts_per_tok}
    with LLM(path, num_kv_blocks=128, max_num_batched_tokens=48, max_prefill_length=19, **tier, **slots) as llm:
        assert ladle_tokens(llm, prompts, GREEDY) == want
        assert ladle_tokens(llm, prompts, GREEDY) == want
        assert llm.stats.experts.misses > 0


def test_qsa_attention_in_query_tiles_equals_one_pass(monkeypatch):
    """The reference attends a long step's queries a tile at a time (bounding its scores at long contexts): the
    same output as all queries at once, for a tile that splits the rows unevenly."""
    from ladle.models.qwen4_exp import indexed_attention as qsa

    torch.manual_seed(0)
    q, k, v = torch.randn(23, 4, 8), torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    mask = torch.rand(23, 40) < 0.6
    mask[:, 0] = True  # every query sees a token
    whole = qsa._masked_attention(q, k, v, mask, 0.3)
    monkeypatch.setattr(qsa, "QUERY_TILE", 5)
    torch.testing.assert_close(qsa._masked_attention(q, k, v, mask, 0.3), whole)


@pytest.mark.parametrize("arch", ["Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"])
def test_the_tool_and_reasoning_parsers_are_qwen3_5s(arch):
    """Derived as for Qwen3.5 (qwen3_coder-style XML calls, <think> blocks), and said so at startup."""
    from ladle.entrypoints.openai.chat.settings import resolve_chat_settings

    chat = resolve_chat_settings(None, None, False, None, arch)
    assert chat.tool_format is not None and chat.tool_format.name == "qwen3_coder" and chat.auto_tool_choice
    assert chat.reasoning is not None
    assert f"tool-call-parser         qwen3_coder  (derived from {arch})" in chat.report()
    assert f"reasoning-parser         qwen3  (derived from {arch})" in chat.report()
