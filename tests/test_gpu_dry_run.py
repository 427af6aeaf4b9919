"""The device script (benchmarks/gpu_h200.py) in its CPU dry run: every section runs to the end on tiny shapes, each
check inside it passes, and the table it prints at the end covers every section. Device time is a few minutes a
session, so a section that would fail on its control flow must fail here first."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_h200.py"
# Every section but kernel_speed, which runs on CUDA alone (the tensor-parallel one runs gloo ranks on CPU).
SECTIONS_ON_CPU = {"kernel_check", "ops_check", "fp8_check", "engine_vs_hf", "structured_check", "ladle_8b_startup",
                   "ladle_8b_decode_batch1", "ladle_8b_decode_cuda_graphs", "ladle_8b_mixed_cuda_graphs",
                   "ladle_8b_prefill_chunk64", "ladle_8b_prefill_chunk128", "ladle_8b_prompt_131k",
                   "ladle_8b_offline_1000x1000", "seed_a_14b", "hf_build", "hf_batch1", "hf_batch4", "tensor_parallel",
                   "expert_tiering", "spec_decode", "prefix_checkpoints", "host_tier",
                   "gguf"}


def _oks(res: object, where: str) -> list[tuple[str, object]]:
    """Every `ok` inside a section's result, with where it sits."""
    if not isinstance(res, dict):
        return []
    found = [(where, res["ok"])] if "ok" in res else []
    return found + [x for k, v in res.items() for x in _oks(v, f"{where}/{k}")]


@pytest.mark.slow
def test_dry_run_every_section_passes(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the dry run is the CPU one on any machine
    # A time budget no CPU run reaches: the device's 450 s would skip the last sections on a busy machine (seen
    # here), and this checks that every section runs, not how fast; the timeout still ends a hang.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--time-budget", "100000", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sections = json.loads((tmp_path / "results.json").read_text())["sections"]
    assert set(sections) == SECTIONS_ON_CPU
    broken = {name: res.get("error") or res.get("skipped") for name, res in sections.items()
              if "error" in res or "skipped" in res}
    assert not broken, broken
    failed = [where for name, res in sections.items() for where, ok in _oks(res, name) if ok is not True]
    assert not failed, failed
    table = proc.stdout.split("== ladle on cpu", 1)[1]
    for name in sections:
        assert f"\n{name} " in table, name
    # A rerun of one section into the same results keeps the others (the device's second call).
    rerun = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "fp8", "--merge",
                            str(tmp_path / "results.json"), "--out", str(tmp_path / "rerun")], capture_output=True,
                           text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    merged = json.loads((tmp_path / "rerun" / "results.json").read_text())["sections"]
    assert set(merged) == SECTIONS_ON_CPU
    assert merged["fp8_check"]["ok"] is True and merged["expert_tiering"] == sections["expert_tiering"]
