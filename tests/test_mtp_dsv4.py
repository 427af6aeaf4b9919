"""DeepSeek-V4's MTP layer drafting (method mtp): its drafts are those of a reference built from HF's own decoder
layer and hyper-connection head, under chunked prefill; they never change the tokens (greedy or seeded, chunked,
preempted, from prefix hits), with the compressors' states rolled back around them."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.testing.mtp_checkpoint import add_mtp_layer, make_predictable
from test_mtp import mtp, record_drafts
from test_spec_decode import drafting, finish_with_abort

SW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
_DSV4 = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
             head_dim=32, intermediate_size=64, moe_intermediate_size=32, q_lora_rank=32, num_experts_per_tok=2,
             n_routed_experts=4, hc_mult=2, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
             index_topk=32, layer_types=[SW, CSA], mlp_layer_types=["hash_moe", "moe"], sliding_window=16,
             compress_rates={CSA: 4, HCA: 8}, max_position_embeddings=4096, tie_word_embeddings=False, seed=2)
# index_topk past the entries these lengths make (under 100 tokens, 4 a entry): no pick among tied indexer scores,
# where HF's topk and ladle's may part (tests/test_deepseek_v4.py, build).


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory) -> str:
    from ladle.demo import build_checkpoint

    return add_mtp_layer(build_checkpoint(tmp_path_factory.mktemp("dsv4_mtp"), "deepseek_v4", **_DSV4), seed=1)


@pytest.fixture(scope="module")
def predictable_dir(tmp_path_factory) -> str:
    from ladle.demo import build_checkpoint

    path = build_checkpoint(tmp_path_factory.mktemp("dsv4_mtp_p"), "deepseek_v4", **_DSV4)
    return make_predictable(add_mtp_layer(path, seed=1), noise=0.1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(500) for _ in range(n)] for n in (40, 23, 57)]


class ReferenceMtp:
    """DeepSeek's MTPBlock from HF's modules: the target's streams before their collapse (HF's model, read at its
    hc_head), then streams = h_proj(hnorm(streams)) + e_proj(enorm(embed(next token))), HF's decoder layer for
    the block (run as the last layer of an HF model one layer longer, its input swapped in), HF's hyper head with
    the MTP layer's own parameters, its norm and the model's head."""

    def __init__(self, path: str, tmp: Path) -> None:
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

        weights = load_file(f"{path}/model.safetensors")
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = self.hf.config
        n_layers, own = config.num_hidden_layers, {k[len("mtp.0."):]: v for k, v in weights.items()
                                                   if k.startswith("mtp.0.")}
        extra = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
                 "hc_head_base", "hc_head_scale"}
        longer = tmp / "longer"
        shutil.copytree(path, longer)
        raw = json.loads((longer / "config.json").read_text())
        raw.update(num_hidden_layers=n_layers + 1, layer_types=raw["layer_types"] + [SW],
                   mlp_layer_types=raw["mlp_layer_types"] + ["moe"])
        (longer / "config.json").write_text(json.dumps(raw))
        block = {f"model.layers.{n_layers}.{k}": v for k, v in own.items() if k not in extra}
        save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")} | block,
                  longer / "model.safetensors", metadata={"format": "pt"})
        self.longer = AutoModelForCausalLM.from_pretrained(longer, dtype=torch.float32).eval()
        self.own = own
        self.head = DeepseekV4HyperHead(config)
        self.head.hc_fn.data, self.head.hc_base.data = own["hc_head_fn"], own["hc_head_base"]
        self.head.hc_scale.data = own["hc_head_scale"]
        self.eps = config.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.own[f"{name}.weight"]

    @staticmethod
    def _streams_into(module: torch.nn.Module, run) -> torch.Tensor:
        """The streams module (an hc_head) is called with while run() runs."""
        seen = []
        handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        try:
            run()
        finally:
            handle.remove()
        return seen[-1][0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        model, longer = self.hf.model, self.longer.model
        streams = self._streams_into(model.hc_head, lambda: model(input_ids=torch.tensor([tokens[:-1]])))
        nexts, out = list(tokens[1:]), []
        for _ in range(k):
            ids = torch.tensor([nexts])
            embeds = model.embed_tokens(ids)[0]
            x = (self._norm(streams, "hnorm") @ self.own["h_proj.weight"].T
                 + (self._norm(embeds, "enorm") @ self.own["e_proj.weight"].T).unsqueeze(1))
            swap = longer.layers[-1].register_forward_pre_hook(lambda m, args: (x[None], *args[1:]))
            try:
                y = self._streams_into(longer.hc_head, lambda: longer(input_ids=ids))
            finally:
                swap.remove()
            logits = self.hf.lm_head(self._norm(self.head(y[-1:][None])[0, 0], "norm"))
            out.append(int(logits.argmax()))
            streams, nexts = torch.cat((streams, y[-1:])), nexts + [out[-1]]
        return out


def test_drafts_are_the_reference_layers_under_chunked_prefill(random_dir, prompts, tmp_path):
    llm = drafting(LLM(random_dir, max_num_batched_tokens=64, max_prefill_length=19, max_model_len=1024,
                       speculative_config=mtp(3)))
    seen = record_drafts(llm)
    ladle_tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    ref = ReferenceMtp(random_dir, tmp_path)
    assert len(seen) >= 20 and sum(len(d) == 3 for _, d in seen) >= len(seen) // 2
    for tokens, drafts in seen:
        assert list(drafts) == ref.drafts(list(tokens), len(drafts)), f"after {len(tokens)} tokens"


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_the_plain_run_and_hf(k, predictable_dir, prompts):
    """Chunked, then from the prefix cache, then preempted; drafts accepted and rejected, so the compressors'
    states roll back."""
    want = ladle_tokens(LLM(predictable_dir, max_num_batched_tokens=64, max_model_len=1024), prompts, GREEDY)
    llm = drafting(LLM(predictable_dir, max_num_batched_tokens=64, max_prefill_length=19, max_model_len=1024,
                       speculative_config=mtp(k)))
    assert ladle_tokens(llm, prompts, GREEDY) == want
    s = llm.stats
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    assert ladle_tokens(llm, prompts, GREEDY) == want and s.prefix_cache_hits > 0
    if k == 3:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(predictable_dir, dtype=torch.float32).eval()
        assert want == [hf_greedy(hf, p, 30) for p in prompts]
        # Six 30-token prompts: 10 blocks admit some, which outgrow them.
        six = [[random.Random(3 + i).randrange(500) for _ in range(30)] for i in range(6)]
        tight = drafting(LLM(predictable_dir, max_num_batched_tokens=64, num_kv_blocks=10, max_model_len=1024,
                             speculative_config=mtp(k)))
        assert ladle_tokens(tight, six, GREEDY) == ladle_tokens(LLM(predictable_dir, max_model_len=1024), six, GREEDY)
        assert tight.stats.num_preemptions > 0
        done = finish_with_abort(llm, prompts, GREEDY, 5, "1")  # an abort leaves the others as they were
        assert "1" not in done and [done["0"], done["2"]] == [want[0], want[2]]
        seeded = SamplingParams(temperature=0.8, seed=4, max_tokens=30, ignore_eos=True)
        assert ladle_tokens(llm, prompts, seeded) == ladle_tokens(LLM(predictable_dir, max_model_len=1024),
                                                                   prompts, seeded)
