"""The memory plan of a Qwen3.8-Flash-Next-shaped Qwen4-Exp (issue 60) at a 32 GiB device budget, in bf16, from its
config alone: the model built on the meta device (118.6B parameters, nothing allocated), its weights counted where
the plan puts them (the PLE tables, the routed experts), its KV layout from its cache specs
(ladle.startup.config_plan). The config is ladle.testing.flash_next_config (HF's defaults and the issue's figures;
each number says where it came from).

A step's activations need a real forward: they are profiled here, as `ladle plan --load-format dummy` profiles
them at startup, on a model of the same widths (hidden, heads, indexer, PLE, hyper-connections, vocabulary, top-10
routing) cut to one PLE Gated DeltaNet layer and one QSA layer, 16 experts and small PLE tables, in bf16 on this
CPU at the plan's context (activations are one layer's at a time, and do not grow with experts or table rows).
16 running requests (a one-box deployment like the issue's RTX 5090: each holds a 62 MiB state slot).

    python benchmarks/qwen4_flash_next_plan.py     # the profile: about 5 minutes on 2 cores, 5.6 GiB resident
"""
from __future__ import annotations

import tempfile

from common import RESULTS

BUDGET = 32 * 2**30
MAX_NUM_SEQS = 16


def cut_config():  # noqa: ANN201 (a transformers config)
    from ladle.testing.flash_next_config import flash_next_config

    config = flash_next_config()
    config.num_hidden_layers, config.layer_types = 2, ["linear_attention", "indexed_attention"]
    config.num_experts, config.ple_layer_ids, config.ngram_vocab_size_base = 16, [1], 1000
    return config


def profiled_activation():  # noqa: ANN201 (an ActivationModel)
    from ladle.config.engine_args import EngineArgs
    from ladle.startup.setup import load_and_plan

    path = tempfile.mkdtemp(prefix="flash-next-cut-")
    cut_config().save_pretrained(path)
    args = EngineArgs(model=path, load_format="dummy", dtype="bfloat16", device="cpu", max_num_seqs=MAX_NUM_SEQS)
    config = load_and_plan(args, frozenset({"load_format", "dtype", "device", "max_num_seqs"})).config
    assert config.plan is not None
    return config.plan.inputs.activation


def main() -> None:
    from ladle.config.engine_args import EngineArgs
    from ladle.startup.config_plan import plan_from_config
    from ladle.testing.flash_next_config import flash_next_config

    activation = profiled_activation()
    args = EngineArgs(model="flash-next", max_num_seqs=MAX_NUM_SEQS)
    plan = plan_from_config(flash_next_config(), activation, BUDGET, args, frozenset({"memory_budget",
                                                                                      "max_num_seqs"}))
    text = ["## Qwen3.8-Flash-Next-shaped memory plan (Qwen4-Exp, issue 60)", "",
            "The plan at a 32 GiB device budget in bf16, from the config alone (`ladle.testing.flash_next_config`: "
            "HF's Qwen4ExpTextConfig defaults and issue 60's figures, the fields HF leaves unset marked assumed "
            "there), built on the meta device: nothing allocated. `python benchmarks/qwen4_flash_next_plan.py`", "",
            f"{plan.parameters / 1e9:.1f}B parameters counted (the issue says 125B: HF's default widths give less, "
            "and the issue does not say which differs). The activation model is profiled on a cut model of the same "
            "widths (two layers, 16 experts, small PLE tables) in bf16 on this CPU, at the plan's context; 16 running "
            "requests.", "",
            "```", plan.report(), "```", ""]
    (RESULTS / "qwen4_flash_next_plan.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
