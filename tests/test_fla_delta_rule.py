"""The CUDA path's gated delta rule (flash-linear-attention's chunked kernel, varlen, states gathered from
and scattered to their slots) against the torch reference, in Triton's interpreter on CPU: step by step with
fresh chunks, continued chunks and decodes side by side, and a whole Qwen3.5 model end to end."""
from __future__ import annotations

import builtins
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

from ladle.attention.metadata import StateMetadata  # noqa: E402
from ladle.models.layers.delta_rule import fla_gated_delta_rule, torch_gated_delta_rule  # noqa: E402

pytestmark = [pytest.mark.slow]


@pytest.fixture(autouse=True)
def interpretable_fla(monkeypatch):
    """Two gaps of Triton's interpreter that fla's kernels meet, closed for these tests only: the autotuner
    wants a GPU to time its configs (any config computes the same), and fla's state kernel calls .to() on its
    loop counter, which the interpreter hands out as a Python int."""
    if ON_GPU:
        return
    import triton.language as tl
    import triton.runtime.autotuner as autotuner
    from fla.ops.common import chunk_delta_h

    def tensor_range(*bounds):
        for i in builtins.range(*(int(b) for b in bounds)):
            yield tl.full((), i, tl.int32)

    monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, config=None, **k: [0.0, 0.0, 0.0])
    monkeypatch.setattr(chunk_delta_h, "range", tensor_range, raising=False)


def _meta(lens: list[int], slots: list[int], continuing: list[bool]) -> StateMetadata:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return StateMetadata(torch.tensor(slots, device=DEVICE), tuple(slots), torch.tensor(cu, device=DEVICE),
                         torch.tensor(cu), tuple(cu), tuple(continuing))


def test_the_fla_rule_matches_the_reference_across_steps():
    """Four steps over five slots: first chunks (one starting on a slot dirty from an earlier request),
    continued chunks across the 64-token block edge, decodes, grouped value heads; outputs and every state."""
    key_heads, value_heads, dk, dv = 2, 4, 16, 24
    g = torch.Generator().manual_seed(0)
    states = torch.randn(5, value_heads, dk, dv, generator=g).to(DEVICE)  # garbage a fresh chunk must ignore
    ref, fla = states.clone(), states.clone()
    steps = [([70, 5, 1], [3, 0, 4], [False, False, False]),
             ([1, 30, 1], [3, 0, 4], [True, True, True]),
             ([1, 1, 9, 1], [3, 0, 1, 4], [True, True, False, True]),
             ([1, 1, 1, 1], [1, 3, 0, 4], [True, True, True, True])]
    for lens, slots, continuing in steps:
        t = sum(lens)
        q, k = (torch.randn(t, key_heads, dk, generator=g).to(DEVICE) for _ in range(2))
        v = torch.randn(t, value_heads, dv, generator=g).to(DEVICE)
        decay = -torch.rand(t, value_heads, generator=g).to(DEVICE)
        beta = torch.rand(t, value_heads, generator=g).to(DEVICE)
        meta = _meta(lens, slots, continuing)
        want = torch_gated_delta_rule(q, k, v, decay, beta, ref, meta)
        got = fla_gated_delta_rule(q, k, v, decay, beta, fla, meta)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()
        assert torch.allclose(fla, ref, atol=2e-5, rtol=1e-4), (fla - ref).abs().max()
    assert torch.equal(fla[2], states[2])  # a slot no step named is left alone


def test_a_qwen3_5_model_runs_the_fla_rule_end_to_end(tmp_path):
    """Chunked prefill (state carried over chunks) and decodes through the CUDA path's rule: same greedy
    tokens as the torch reference."""
    from ladle import LLM, SamplingParams
    from ladle.demo import build_checkpoint
    from ladle.models.layers.gated_deltanet import GatedDeltaNet
    from ladle.models.layers.ops import TritonOps

    path = build_checkpoint(tmp_path / "q35", "qwen3_5", vocab_size=512, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32,
                            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1,
                            linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, seed=4)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, max_num_batched_tokens=16).generate(prompts, greedy,
                                                                                           use_tqdm=False)]
    llm = LLM(path, max_num_batched_tokens=16)
    mixers = [m for m in llm.engine.core.model_executor.runner.model.modules() if isinstance(m, GatedDeltaNet)]
    ops = TritonOps()
    assert ops.has_fla and mixers
    for m in mixers:
        m.ops = ops
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
