"""CPU threads as a setting: explicit, from OMP_NUM_THREADS, or derived from the usable CPUs less the reserved
ones (the server's engine process, pinned to the rest)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ladle import LLM
from ladle.startup.threads import usable_cpus


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_explicit_num_threads_is_used_and_shown(tiny_qwen3_dir, keep_threads):
    llm = LLM(tiny_qwen3_dir, num_threads=1)
    assert torch.get_num_threads() == 1
    assert llm.config.settings["num_threads"].value == 1 and llm.config.settings["num_threads"].source == "explicit"
    assert sorted(os.sched_getaffinity(0)) == usable_cpus()  # an offline LLM never pins its caller's process


def test_derived_from_the_usable_cpus_or_omp_num_threads(tiny_qwen3_dir, keep_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    setting = LLM(tiny_qwen3_dir).config.settings["num_threads"]
    assert (setting.value, setting.source) == (len(usable_cpus()), "derived")
    assert f"the {len(usable_cpus())} CPUs this process may use" in setting.reason
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    setting = LLM(tiny_qwen3_dir).config.settings["num_threads"]
    assert (setting.value, setting.reason) == (1, "OMP_NUM_THREADS")


def test_more_threads_than_cpus_is_refused(tiny_qwen3_dir):
    with pytest.raises(ValueError, match=f"exceeds the {len(usable_cpus())} CPUs"):
        LLM(tiny_qwen3_dir, num_threads=len(usable_cpus()) + 1)


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="reserving a CPU needs two")
def test_reserved_cpus_pin_the_process_to_the_rest():
    """What the server's engine process does (reserved_cpus=1): fewer threads, and the process kept off the
    reserved CPU. In a child process: pinning is process-wide."""
    code = ("import os, torch; from ladle.config.engine_args import EngineArgs; from ladle.config.provenance import Provenance; "
            "from ladle.startup.threads import apply_threads, resolve_threads; "
            "args = EngineArgs(model='m', reserved_cpus=1); prov = Provenance(frozenset()); "
            "n = resolve_threads(args, prov); apply_threads(n, torch.device('cpu'), pin=True); "
            "print(n, torch.get_num_threads(), sorted(os.sched_getaffinity(0)), prov.settings['num_threads'].reason)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    cpus = usable_cpus()
    assert out.stdout.split("[")[0].split() == [str(len(cpus) - 1)] * 2, out.stderr
    assert f"{sorted(cpus[:-1])}" in out.stdout and "less 1 for the API process" in out.stdout


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="binding a team of two needs two CPUs")
def test_each_openmp_thread_is_bound_to_its_own_cpu():
    """vLLM's per-thread binding: after bind_openmp_threads, torch's team (reused by a real matmul) holds one
    thread per CPU, each with a one-CPU mask, and the matmul still gives the right answer."""
    code = ("import torch; from pathlib import Path; from ladle.startup.threads import bind_openmp_threads as bind, "
            "usable_cpus; cpus = usable_cpus()[:2]; torch.set_num_threads(2); print(bind(cpus)); "
            "x = torch.randn(512, 512, dtype=torch.float64); assert torch.allclose(x @ x.T, (x @ x.T).T); "
            "print(' '.join(line.split()[-1] for t in Path('/proc/self/task').iterdir() "
            "for line in (t / 'status').read_text().splitlines() if line.startswith('Cpus_allowed_list')))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    bound, masks = out.stdout.strip().splitlines()
    cpus = usable_cpus()[:2]
    assert bound == str(cpus)
    one_cpu = [m for m in masks.split() if m.isdigit()]
    assert sorted(set(one_cpu)) == sorted(str(c) for c in cpus)
