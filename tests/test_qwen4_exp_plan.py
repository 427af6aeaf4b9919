"""The Qwen3.8-Flash-Next-shaped memory plan (issue 60) from its config alone: the 118.6B-parameter model on the
meta device (nothing allocated), the PLE tables and the routed experts placed off a 32 GiB device, a chunk derived.
The activation model is given (benchmarks/qwen4_flash_next_plan.py profiles a real one)."""
from __future__ import annotations

import pytest

from ladle.config.engine_args import EngineArgs
from ladle.startup.config_plan import plan_from_config
from ladle.startup.profiling import ActivationModel
from ladle.testing.flash_next_config import flash_next_config

MiB, GiB = 2**20, 2**30
# 512 MiB + 40 KiB a token: about what a bf16 step of these widths takes (the benchmark measures it).
ACTIVATION = ActivationModel((512 * MiB, 40 * 1024.0, 0.0, 0.0), (256 * MiB, 2 * MiB), 1024, 16, ())


@pytest.fixture(scope="module")
def config():
    return flash_next_config()


def test_the_flash_next_plan_at_32_gib_puts_the_tables_and_experts_off_the_device(config):
    plan = plan_from_config(config, ACTIVATION, 32 * GiB, EngineArgs(model="flash-next", max_num_seqs=16))
    report, p = plan.report(), plan.plan
    assert 118e9 < plan.parameters < 119e9
    # 2 layers x 16 heads x ~20M rows x 80 bf16 values: the tables live in host memory, not in the weights.
    tables = next(line for line in report.splitlines() if "PLE n-gram tables" in line)
    assert "95.37 GiB in 2 layers, in host memory" in tables
    assert plan.settings.settings["ple_table"].source == "derived"
    assert "tiered experts: 120.00 GiB in host memory" in report
    slots = plan.settings.settings["moe_cache_size"].value
    assert 10 <= slots < 512 * 40
    assert p.inputs.weights < 32 * GiB * 0.7
    assert p.max_prefill_length % 64 == 0 and p.max_prefill_length > 0 and p.headroom >= 0
    assert p.max_model_len == config.max_position_embeddings
    # The QSA layers' KV at its real size: 10 layers of 2 x 2 x 256 bf16 K/V (a 16-token block each), and their
    # indexer keys, 128 bf16 a token, in a group of their own whose pages hold 8 x 16 tokens' keys.
    keys = plan.layout.groups[1].spec
    assert (keys.block_scale, plan.layout.block_bytes // 16) == (8, 10 * 2 * 2 * 256 * 2)
    assert p.inputs.request_blocks(32768, 8192) == 32768 // 16 + 32768 // 128


def test_a_budget_that_holds_every_weight_keeps_them_on_the_device(config):
    plan = plan_from_config(config, ACTIVATION, 512 * GiB, EngineArgs(model="flash-next", max_num_seqs=16))
    assert plan.settings.settings["ple_table"].value == "device"
    assert plan.settings.settings["moe_cache_size"].value == "off"
    assert plan.plan.inputs.weights > 220 * GiB and "on the device (in the weights)" in plan.report()


def test_an_explicit_ple_table_is_honoured(config):
    args = EngineArgs(model="flash-next", max_num_seqs=16, ple_table="host")
    plan = plan_from_config(config, ACTIVATION, 512 * GiB, args, frozenset({"ple_table"}))
    assert plan.settings.settings["ple_table"].source == "explicit"
    assert "in host memory, not in the weights" in plan.report()
