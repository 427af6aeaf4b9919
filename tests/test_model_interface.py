"""Every registered model class meets the CausalLM protocol the loader, planner and runner call, member by
member (a new model missing one fails here, not at a user's first load), and the protocol's optional hooks are
real no-ops where a model has nothing to do."""
from __future__ import annotations

import inspect

import pytest

from ladle.models.interface import CausalLM, RoutedExperts, causal_lm_members
from ladle.models.registry import MODELS

MODULE_SURFACE = {"parameters", "buffers", "modules"}  # nn.Module's own, with its own signatures
METHODS = [n for n in causal_lm_members()
           if inspect.isfunction(getattr(CausalLM, n, None)) and n not in MODULE_SURFACE]


def test_the_protocol_names_the_hooks_the_engine_calls():
    assert {"cache_specs", "forward", "compute_logits", "load_weights", "shard", "init_dummy_buffers",
            "lay_out_for_cpu", "tensor_parallel", "cpu_kernels"} <= set(causal_lm_members())


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_every_model_class_has_every_member(arch):
    cls = MODELS[arch]
    missing = [n for n in causal_lm_members() if not hasattr(cls, n)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    for name in METHODS:
        want = list(inspect.signature(getattr(CausalLM, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert len(got) == len(want), f"{cls.__name__}.{name}{got} does not take {want}"
    assert isinstance(cls.tensor_parallel, bool)
    assert cls.cpu_kernels is None or len(cls.cpu_kernels) == 2


def test_moe_layers_are_routed_experts_and_start_with_their_own_routing():
    from ladle.models.deepseek_v4.moe import MoE
    from ladle.models.layers.moe import SharedExpertMoeBlock, SparseMoeBlock

    for cls in (MoE, SparseMoeBlock, SharedExpertMoeBlock):
        assert issubclass(cls, RoutedExperts)
    assert RoutedExperts().force_worst_routing is False



def test_set_ops_reaches_every_module_that_runs_ops():
    """The loader's set_ops finds its modules by type (OpsModule): every norm, attention and expert layer of a
    Qwen3-MoE gets the ops it is given, and no module holds ops that set_ops would pass over."""
    import torch
    from transformers import Qwen3MoeConfig

    from ladle.models.layers.ops import OpsModule, TorchOps, set_ops
    from ladle.models.qwen3_moe import Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    given = TorchOps()
    set_ops(model, given)
    users = [m for m in model.modules() if isinstance(m, OpsModule)]
    assert {"RMSNorm", "Attention", "FusedMoE"} <= {type(m).__name__ for m in users}
    assert all(m.ops is given for m in users)
    assert not [m for m in model.modules() if "ops" in vars(m) and not isinstance(m, OpsModule)]
