"""Tiered experts' settings: explicit ones honoured or refused naming what to change, derived ones with their
reason, the plan's line on resident vs tiered bytes, and the cache's counters on /metrics."""
from __future__ import annotations

import pytest

from ladle import LLM, SamplingParams
from ladle.config.engine_args import EngineArgs
from ladle.engine.core_output import EngineSnapshot
from ladle.entrypoints.openai.metrics import ServerMetrics


@pytest.mark.parametrize("kwargs,message", [
    ({"moe_cache_size": 0}, "moe_cache_size must be a positive integer"),
    ({"moe_cache_fraction": 1.5}, r"moe_cache_fraction must be in \(0, 1\]"),
    ({"moe_cache_size": 4, "moe_cache_fraction": 0.5}, "give one of them"),
    ({"moe_strategy": "gpu"}, "choose one of offload, cpu, hybrid"),
    ({"moe_backing": "disk"}, "choose one of host, mmap"),
])
def test_bad_values_are_refused_before_loading(moe_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(moe_dir, **kwargs).validate()


@pytest.mark.parametrize("kwargs,message", [
    ({"moe_cache_size": 1}, "fewer than a token's 2 routed experts; give at least 2"),
    ({"moe_cache_size": 17}, "exceeds the model's 16 routed experts"),
    ({"moe_strategy": "cpu", "moe_cache_size": 4}, "caches none; drop moe_cache_size"),
    ({"moe_strategy": "cpu", "moe_prefetch": True}, "moe_strategy cpu does not use; drop it"),
    ({"moe_prefetch": True}, "every expert fits on the device and none is tiered"),
    ({"moe_strategy": "hybrid"}, "every expert fits on the device and none is tiered"),
    ({"moe_cache_size": 4, "load_format": "dummy"}, "load_format dummy has none of; use moe_backing host"),
    ({"moe_cache_size": 16, "memory_budget": 800 * 1024}, r"the budget holds \d+; give at most \d+"),
])
def test_settings_that_cannot_hold_are_refused_naming_what_to_change(moe_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(moe_dir, **kwargs)


def test_a_model_without_experts_refuses_the_settings(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="moe_cache_size is set, but this model has no routed experts"):
        LLM(tiny_qwen3_dir, moe_cache_size=4)


def test_the_plan_and_settings_say_what_is_tiered(moe_dir):
    with LLM(moe_dir, moe_cache_size=4, num_kv_blocks=64) as llm:
        cfg = llm.engine.core.config
        line = next(line for line in cfg.plan.lines() if "tiered experts" in line)
        assert "read from the checkpoint's files when needed; 4 slots on the device" in line
        assert cfg.settings["moe_cache_size"].source == "explicit"
        assert cfg.settings["moe_backing"].value == "mmap" and "on CPU" in cfg.settings["moe_backing"].reason
        assert "4 of 16 experts" in cfg.settings["tiered_experts"].value
        assert cfg.settings["moe_prefetch"].value is False and "same cores" in cfg.settings["moe_prefetch"].reason
        llm.generate([{"prompt_token_ids": [1, 2, 3] * 10}], SamplingParams(max_tokens=4), use_tqdm=False)
        assert llm.stats.experts.misses > 0 and llm.stats.steps[-1].moe_fetch_ms >= 0
        e = llm.stats.experts
        assert sum(s.moe_fetch_ms for s in llm.stats.steps) == pytest.approx(e.fetch_seconds * 1e3)
        assert sum(s.moe_wait_ms for s in llm.stats.steps) == pytest.approx(e.wait_seconds * 1e3)
        assert llm.engine.core.snapshot().moe_cache_misses == e.misses


def test_hybrid_shows_its_measured_threshold(moe_dir):
    with LLM(moe_dir, moe_cache_size=4, moe_strategy="hybrid", moe_backing="host", num_kv_blocks=64) as llm:
        setting = llm.engine.core.config.settings["moe_hybrid_in_place_tokens"]
        assert setting.source == "derived" and "measured: fetch" in setting.reason


def test_cache_counters_reach_metrics():
    metrics = ServerMetrics("m")
    metrics.on_snapshot(0, EngineSnapshot(moe_cache_hits=5, moe_cache_misses=3, moe_bytes_fetched=4096,
                                  moe_fetch_seconds=0.25, moe_fetch_wait_seconds=0.125, moe_computed_in_place=1,
                                  moe_prefetched=2))
    text = metrics.render().decode()
    for line in ('ladle:moe_cache_hits_total{model_name="m"} 5.0', 'ladle:moe_cache_misses_total{model_name="m"} 3.0',
                 'ladle:moe_bytes_fetched_total{model_name="m"} 4096.0',
                 'ladle:moe_fetch_seconds_total{model_name="m"} 0.25',
                 'ladle:moe_experts_computed_in_place_total{model_name="m"} 1.0',
                 'ladle:moe_fetch_wait_seconds_total{model_name="m"} 0.125',
                 'ladle:moe_prefetched_total{model_name="m"} 2.0'):
        assert line in text


def test_an_incomplete_expert_in_the_files_fails_at_load_naming_it(moe_dir, tmp_path):
    """The mmap tier never reads the experts at load, so it checks from the headers that every expert's rows are
    in the files: a checkpoint missing one expert's up projection is refused with the expert named."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(moe_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds 32 of the 64 rows of model\.layers\.2\.mlp\.experts expert 5's w13"):
        LLM(str(broken), moe_cache_size=4, moe_backing="mmap")
