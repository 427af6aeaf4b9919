"""Lending the API process's reserved CPUs to the engine's steps while they idle (ladle/startup/cpu_lending.py):
the load arithmetic, the lender's decisions, the real thing in a pinned engine process beside a busy
neighbour, and the property that makes it safe: a step gives the same bits at any thread count."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.demo import build_checkpoint
from ladle.startup.cpu_lending import OTHER_LOAD_LIMIT, WINDOW_S, CpuLender, CpuLending, CpuTicks, other_load, read_ticks
from ladle.config.provenance import Provenance
from ladle.startup.threads import keep_lending, usable_cpus


def test_other_load_leaves_out_this_process_own_time():
    before = CpuTicks(busy=100, total=1000, own=50)
    # 40 ticks of 100 went to busy work on two CPUs, 30 of them this process's: 10 others' = 0.2 CPU.
    assert other_load(before, CpuTicks(busy=140, total=1100, own=80), num_cpus=2) == pytest.approx(0.2)
    assert other_load(before, CpuTicks(busy=140, total=1100, own=95), num_cpus=2) == 0.0  # tick rounding
    assert other_load(before, before, num_cpus=2) == 0.0


def test_read_ticks_sums_the_watched_cpus(tmp_path: Path):
    (tmp_path / "self").mkdir()
    (tmp_path / "stat").write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                                   "cpu0 10 1 2 100 3 4 5 6 0 0\n"
                                   "cpu1 20 0 0 50 0 0 0 0 7 0\n"
                                   "cpu2 99 0 0 1 0 0 0 0 0 0\nintr 5\n")
    # comm may hold spaces and parentheses; utime and stime are fields 14 and 15.
    (tmp_path / "self" / "stat").write_text("42 (a (b) c) S " + " ".join(["0"] * 10) + " 17 8 0 0 20\n")
    ticks = read_ticks((0, 1), tmp_path)
    assert ticks == CpuTicks(busy=(10 + 1 + 2 + 4 + 5 + 6) + 20, total=131 + 70, own=25)


class FakeMachine:
    def __init__(self) -> None:
        self.now, self.ticks, self.reads = 0.0, CpuTicks(0, 0, 0), 0

    def advance(self, seconds: float, other_cpus: float, own_cpus: float, num_cpus: int = 2) -> None:
        total = int(seconds * 100 * num_cpus)
        own = int(seconds * 100 * own_cpus)
        busy = own + int(seconds * 100 * other_cpus)
        self.now += seconds
        self.ticks = CpuTicks(self.ticks.busy + busy, self.ticks.total + total, self.ticks.own + own)

    def read(self) -> CpuTicks:
        self.reads += 1
        return self.ticks


def test_the_lender_lends_while_others_leave_the_cpus_idle_and_stops_when_they_do_not():
    machine, calls = FakeMachine(), []
    lender = CpuLender(CpuLending(base_threads=1, cpus=(0, 1)), calls.append, machine.read,
                       lambda: machine.now)
    assert lender.before_step() == 1  # nothing measured yet
    machine.advance(0.5, other_cpus=0.03, own_cpus=2.0)  # the engine itself keeps both busy: not others' load
    assert lender.before_step() == 2 and calls == [2]
    reads = machine.reads
    machine.advance(WINDOW_S / 4, other_cpus=1.0, own_cpus=1.0)
    assert lender.before_step() == 2 and machine.reads == reads  # within a window: no reading, no change
    machine.advance(1.5 * WINDOW_S, other_cpus=1.0, own_cpus=1.0)  # a neighbour takes a whole CPU
    assert lender.before_step() == 1 and calls == [2, 1] and lender.last_load > OTHER_LOAD_LIMIT
    machine.advance(1.5 * WINDOW_S, other_cpus=OTHER_LOAD_LIMIT * 2, own_cpus=1.0)
    assert lender.before_step() == 1 and calls == [2, 1]  # no call when nothing changes
    machine.advance(1.5 * WINDOW_S, other_cpus=0.0, own_cpus=1.0)
    lender.observe()  # an idle engine keeps reading: the next step is judged by the last window alone
    machine.advance(1.5 * WINDOW_S, other_cpus=1.0, own_cpus=0.0)
    assert lender.before_step() == 1 and calls == [2, 1, 2, 1]


def test_a_mixture_of_experts_model_is_not_lent_to(moe_dir):
    """Its experts' index_add_ sums differ by thread count, so load would change its outputs."""
    lending = CpuLending(base_threads=1, cpus=(0, 1))
    prov = Provenance(frozenset())
    moe = LLM(moe_dir, num_threads=1).engine.core.model_executor.runner.model
    assert keep_lending(lending, torch.nn.Sequential(torch.nn.Linear(2, 2)), prov) is lending
    assert keep_lending(lending, moe, prov) is None
    assert prov.settings["lent_cpus"].value == "none" and "mixture-of-experts" in prov.settings["lent_cpus"].reason


def test_explicit_num_threads_lends_nothing(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, num_threads=1)
    setting = llm.config.settings["lent_cpus"]
    assert (setting.value, setting.reason) == ("none", "num_threads is explicit")
    assert llm.engine.core.lender is None


@pytest.mark.slow
@pytest.mark.skipif(len(usable_cpus()) < 2, reason="lending a reserved CPU needs two")
def test_a_pinned_engine_borrows_the_reserved_cpu_only_while_no_one_else_uses_it(tiny_qwen3_dir):
    """The server's engine process (reserved_cpus=1), in a child process since pinning is process-wide: its
    team is bound across the engine's CPUs and the reserved one; a neighbour spinning on the reserved CPU
    keeps steps at the engine's own threads, and once the readings say the CPUs are free the reserved one is
    lent again (faked readings: the test must not depend on the machine being idle). Tokens stay the same."""
    code = f"""
import os, subprocess, sys, time, torch
from ladle.config.engine_args import EngineArgs
from ladle.engine.core import EngineCore
from ladle.request import Request
from ladle.sampling_params import SamplingParams
core = EngineCore(EngineArgs(model={tiny_qwen3_dir!r}, reserved_cpus=1, enable_prefix_caching=False), frozenset())
s = core.config.settings
print("settings", s["num_threads"].value, s["lent_cpus"].value, s["cpu_binding"].value)
def run(n):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.add_request(core.make_request(f"r{{n}}", list(range(3, 40)), params))
    toks = []
    while core.has_unfinished_requests():
        toks += [t for o in core.step() for t in o.new_token_ids]
    return toks
lent = core.config.cpu_lending.cpus[-1]
spin = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, [{{lent}}])\\nwhile True: pass"])
time.sleep(0.5); core.lender.before_step(); time.sleep(3 * {WINDOW_S})
busy = run(0), core.lender.threads, core.stats.steps_with_lent_cpus
spin.kill(); spin.wait()
# Whatever else this machine runs, the lender's readings now say no one else uses the CPUs (it is the lending
# decision under test, not the machine's load; the busy half above read the real /proc/stat).
from ladle.startup.cpu_lending import CpuTicks
calls = iter(range(1, 10**9))
def quiet():
    k = next(calls)
    return CpuTicks(busy=10 * k, total=100 * k, own=10 * k)
core.lender.read = quiet
core.lender._last = quiet()
time.sleep(3 * {WINDOW_S})
idle = run(1), core.lender.threads, core.stats.steps_with_lent_cpus
print("busy", busy[1], busy[2], "idle", idle[1], idle[2] > 0, "same", busy[0] == idle[0] and len(busy[0]) == 4)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ", 1)[0] in ("settings", "busy"))
    n = len(usable_cpus()) - 1
    cpus = usable_cpus()
    assert lines["settings"] == f"{n} {cpus[-1]} {' '.join(map(str, cpus))}"
    assert lines["busy"] == f"{n} 0 idle {n + 1} True same True"


def _mid_qwen3(tmp_path: Path) -> str:
    """Big enough that torch splits its matmuls, norms and attention across two threads."""
    return build_checkpoint(tmp_path / "mid", "qwen3", vocab_size=2048, hidden_size=256, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=768,
                            seed=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_gives_the_same_bits_at_one_and_two_threads(tmp_path: Path, dtype: str):
    """What makes lending safe: the thread count a step runs with never changes a logprob, in prefill
    chunks, mixed steps or batched decodes."""
    llm = LLM(_mid_qwen3(tmp_path), num_threads=2, dtype=dtype, enable_prefix_caching=False,
              max_num_batched_tokens=160)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 2048, (n,), generator=gen).tolist()} for n in (5, 150, 333)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    finally:
        torch.set_num_threads(2)
    assert runs[0] == runs[1]
