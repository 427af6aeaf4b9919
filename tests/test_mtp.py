"""Speculative decoding with the model's own MTP layer (Qwen3.5): its drafts are those of a torch reference built
from HF's decoder layer, under chunked prefill; they never change the tokens, greedy or seeded, chunked,
preempted, aborted or from prefix hits; what cannot run is refused by name."""
from __future__ import annotations

import random

import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.testing.mtp_checkpoint import add_mtp_layer, make_predictable
from test_spec_decode import drafting, finish_with_abort

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
_Q35 = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096,
            layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False, seed=6)


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def random_mtp_dir(tmp_path_factory) -> str:
    """Random weights, the MTP layer's too: its drafts are rarely accepted, but they are what the reference
    computes."""
    from ladle.demo import build_checkpoint

    return add_mtp_layer(build_checkpoint(tmp_path_factory.mktemp("q35_mtp"), "qwen3_5", **_Q35), seed=1)


@pytest.fixture(scope="module")
def predictable_dir(tmp_path_factory) -> str:
    """Drafts accepted about two times in three, so verification both accepts and rolls back."""
    from ladle.demo import build_checkpoint

    path = build_checkpoint(tmp_path_factory.mktemp("q35_mtp_p"), "qwen3_5", **_Q35)
    return make_predictable(add_mtp_layer(path, seed=1), noise=0.05)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(500) for _ in range(n)] for n in (40, 23, 57)]


@pytest.fixture(scope="module")
def plain_greedy(predictable_dir, prompts) -> list[list[int]]:
    return ladle_tokens(LLM(predictable_dir, max_num_batched_tokens=64, max_model_len=1024), prompts, GREEDY)


class ReferenceMtp:
    """The MTP layer computed from HF's modules: the target's final-normed hidden states (HF's model), then
    fc(cat(norm(embed(next token)), norm(hidden))), HF's Qwen3_5DecoderLayer (full attention, causal mask),
    norm and the head; draft j + 1 feeds draft j and its output back one position on."""

    def __init__(self, path: str) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = self.hf.config
        config._attn_implementation = "eager"
        weights = {k[len("mtp."):]: v for k, v in load_file(f"{path}/model.safetensors").items()
                   if k.startswith("mtp.")}
        self.layer = Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention")).eval()
        self.layer.load_state_dict({k[len("layers.0."):]: v for k, v in weights.items()
                                    if k.startswith("layers.0.")})
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[name] = Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.norms[name].weight.data.copy_(weights[f"{name}.weight"])
        self.fc = weights["fc.weight"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k drafts after tokens (the last one sampled, its KV not yet computed)."""
        model = self.hf.model
        ids = torch.tensor([tokens])
        hidden = model(input_ids=ids[:, :-1]).last_hidden_state[0]  # final-normed, positions 0 .. m - 2
        nexts, out = list(tokens[1:]), []
        for _ in range(k):
            n = len(nexts)
            embeds = model.embed_tokens(torch.tensor([nexts]))[0]
            x = torch.cat((self.norms["pre_fc_norm_embedding"](embeds), self.norms["pre_fc_norm_hidden"](hidden)), -1)
            x = (x @ self.fc.T)[None]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            y = self.layer(x, position_embeddings=model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
            y = self.norms["norm"](y[0])
            out.append(int(self.hf.lm_head(y[-1]).argmax()))
            hidden, nexts = torch.cat((hidden, y[-1:])), nexts + [out[-1]]
        return out


def record_drafts(llm: LLM) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(a request's tokens, the MTP drafts that follow them) after every step that sampled it."""
    scheduler = llm.engine.core.scheduler
    update, seen = scheduler.update_from_output, []

    def recording(sched, sampled):
        outs = update(sched, sampled)
        for s in sched.scheduled:
            if s.request.request_id in sampled and s.request.spec_token_ids:
                seen.append((tuple(s.request.all_token_ids), s.request.spec_token_ids))
        return outs

    scheduler.update_from_output = recording
    return seen


def test_drafts_are_the_reference_layers_under_chunked_prefill(random_mtp_dir, prompts):
    """Every step's drafts, k = 3, equal the reference's for the request's tokens so far: the MTP cache holds
    every position, whichever chunk (19 tokens at most) or decode step wrote it."""
    llm = drafting(LLM(random_mtp_dir, max_num_batched_tokens=64, max_prefill_length=19, max_model_len=1024,
                       speculative_config=mtp(3)))
    seen = record_drafts(llm)
    ladle_tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ref = ReferenceMtp(random_mtp_dir)
    assert len(seen) >= 20 and sum(len(d) == 3 for _, d in seen) >= len(seen) // 2
    for tokens, drafts in seen:
        assert list(drafts) == ref.drafts(list(tokens), len(drafts)), f"after {len(tokens)} tokens"


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_the_plain_run_and_hf(k, predictable_dir, prompts, plain_greedy):
    """Chunked (19-token chunks), then again from the prefix cache; drafts both accepted and rejected."""
    llm = drafting(LLM(predictable_dir, max_num_batched_tokens=64, max_prefill_length=19, max_model_len=1024,
                       speculative_config=mtp(k)))
    assert ladle_tokens(llm, prompts, GREEDY) == plain_greedy
    s = llm.stats
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    assert ladle_tokens(llm, prompts, GREEDY) == plain_greedy and s.prefix_cache_hits > 0
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.pool.ref_counts)
    if k == 3:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(predictable_dir, dtype=torch.float32).eval()
        assert plain_greedy == [hf_greedy(hf, p, 40) for p in prompts]


def test_preemption_and_aborts_keep_the_tokens(predictable_dir, prompts, plain_greedy):
    # 57 + 40 tokens = 7 blocks for the longest: 12 blocks admit two, which outgrow them.
    tight = drafting(LLM(predictable_dir, max_num_batched_tokens=64, num_kv_blocks=12, max_model_len=1024,
                         speculative_config=mtp(3)))
    assert ladle_tokens(tight, prompts, GREEDY) == plain_greedy and tight.stats.num_preemptions > 0
    llm = drafting(LLM(predictable_dir, max_num_batched_tokens=64, max_model_len=1024, speculative_config=mtp(5)))
    done = finish_with_abort(llm, prompts, GREEDY, 6, "1")
    assert "1" not in done and llm.stats.spec_decode_num_accepted_tokens > 0
    assert [done["0"], done["2"]] == [plain_greedy[0], plain_greedy[2]]
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.pool.ref_counts)


def test_seeded_rows_draw_the_same_tokens_with_drafts(predictable_dir, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=40, ignore_eos=True)
    plain = LLM(predictable_dir, max_num_batched_tokens=64, max_model_len=1024)
    llm = drafting(LLM(predictable_dir, max_num_batched_tokens=64, max_model_len=1024, speculative_config=mtp(3)))
    assert ladle_tokens(llm, prompts, params) == ladle_tokens(plain, prompts, params)
    assert llm.stats.spec_decode_num_accepted_tokens > 0


def test_unseeded_random_rows_sample_the_same_distribution(predictable_dir, prompts):
    """600 unseeded samples of the first three tokens (top_k=3): their joint distribution with MTP drafts is the
    plain one's (two-sample chi-square, the n-gram test's)."""
    from collections import Counter

    from test_spec_decode import _chi_square_p

    params = SamplingParams(n=600, temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    prompt = {"prompt_token_ids": prompts[0]}

    def sample(engine: LLM) -> Counter:
        return Counter(tuple(c.token_ids) for c in engine.generate([prompt], params, use_tqdm=False)[0].outputs)

    llm = drafting(LLM(predictable_dir, max_num_batched_tokens=512, max_model_len=1024, speculative_config=mtp(3)))
    with_drafts = sample(llm)
    assert llm.stats.spec_decode_num_accepted_tokens > 50
    assert _chi_square_p(with_drafts, sample(LLM(predictable_dir, max_num_batched_tokens=512,
                                                  max_model_len=1024))) > 1e-3


def test_a_request_opts_out_or_caps_its_drafts(predictable_dir, prompts, plain_greedy):
    """num_speculative_tokens 0: the MTP layer makes no drafts for that request; 1: one a step at most."""
    from dataclasses import replace

    llm = drafting(LLM(predictable_dir, max_num_batched_tokens=64, max_model_len=1024, speculative_config=mtp(3)))
    stats = llm.stats
    for cap, most in ((0, 0), (1, 1), (None, 3)):
        before = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens)
        assert ladle_tokens(llm, prompts, replace(GREEDY, num_speculative_tokens=cap)) == plain_greedy
        rows, drafted = stats.spec_decode_num_drafts - before[0], stats.spec_decode_num_draft_tokens - before[1]
        assert drafted <= most * rows and (drafted > 0) == (most > 0)


def test_qwen3_5_moe_drafts_through_its_experts(tmp_path):
    """The MoE model's MTP layer routes through experts of its own; the tokens are the plain run's and HF's."""
    from ladle.demo import build_checkpoint

    moe = dict(_Q35, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)
    path = make_predictable(add_mtp_layer(build_checkpoint(tmp_path / "moe", "qwen3_5_moe", **moe), seed=2), 0.12)
    prompts = [[random.Random(i).randrange(500) for _ in range(30)] for i in range(2)]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = drafting(LLM(path, max_num_batched_tokens=64, max_prefill_length=19, max_model_len=1024,
                       speculative_config=mtp(3)))
    assert ladle_tokens(llm, prompts, GREEDY) == [hf_greedy(hf, p, 40) for p in prompts]
    assert 0 < llm.stats.spec_decode_num_accepted_tokens < llm.stats.spec_decode_num_draft_tokens


def test_the_layer_rests_where_drafts_have_settled_off(predictable_dir, prompts, plain_greedy):
    """Where the step arms settled on plain steps the MTP layer runs not at all (no drafts, no cache writes);
    only where they have not does it write its cache, drafting or not."""
    llm = LLM(predictable_dir, max_num_batched_tokens=64, max_model_len=1024, speculative_config=mtp(3))
    arms = llm.engine.core.scheduler.speculator.arms
    arms.drafts_now = lambda rows: False
    model, runs = llm.engine.core.model_executor.runner.model, []
    forward = model.mtp_forward
    model.mtp_forward = lambda *a, **kw: runs.append(kw.get("write_only", False)) or forward(*a, **kw)
    for settled in (True, False):
        arms.settled_plain = lambda rows: settled
        runs.clear()
        assert ladle_tokens(llm, prompts, GREEDY) == plain_greedy
        # Settled: only the first step runs it, a prefill step that samples nothing (so asks nothing of the arms).
        assert all(runs) and (len(runs) == 1 if settled else len(runs) >= 40)
    assert llm.stats.spec_decode_num_draft_tokens == 0


def test_what_cannot_run_is_refused_by_name(tiny_qwen3_dir, random_mtp_dir, tmp_path):
    from ladle.demo import build_checkpoint

    with pytest.raises(ValueError, match="Qwen3ForCausalLM has none"):
        LLM(tiny_qwen3_dir, speculative_config=mtp(1))
    with pytest.raises(ValueError, match="read by method 'ngram' only"):
        LLM(random_mtp_dir, speculative_config={**mtp(1), "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="async_scheduling cannot be used with speculative_config method 'mtp'"):
        LLM(random_mtp_dir, speculative_config=mtp(1), async_scheduling=True)
    bare = build_checkpoint(tmp_path / "bare", "qwen3_5", **_Q35)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers = 1 in its config"):
        LLM(bare, speculative_config=mtp(1))
    llm = LLM(random_mtp_dir, speculative_config={"method": "qwen3_5_mtp", "num_speculative_tokens": 2})
    assert "mtp, k=2, drafted by the model's MTP layer" in llm.engine.core.config.report()
