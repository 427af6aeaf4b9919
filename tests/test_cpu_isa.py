"""The CPU's instruction-set level (ladle.kernels.cpu_isa): detected from cpuinfo flags of the CPUs ladle meets,
lowered by LADLE_CPU_ISA and refused above the CPU, each build of the kernels carrying its own level's paths, and
an engine at every level this CPU runs giving HF's greedy tokens."""
from __future__ import annotations

import random

import pytest

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.kernels.cpu_isa import ENV, CpuIsa, cpu_flags, detect, evidence, kernel_levels, resolve, supported
from ladle.kernels.cpu_kernels import load
from ladle.models.layers.cpu_linear import CpuLinear

# The flags of the machines this project has run on (trimmed to the ones that matter and a few that do not).
EPYC_ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 sha_ni"
EPYC_ZEN4 = EPYC_ZEN3 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni avx512vbmi"
XEON_SPR = EPYC_ZEN4 + " avx512_fp16 amx_bf16 amx_tile amx_int8"


def flags(text: str) -> frozenset[str]:
    return cpu_flags(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {text}\n")


@pytest.mark.parametrize("text,level", [
    ("fpu sse sse2 sse4_2 avx", CpuIsa.SCALAR),
    (EPYC_ZEN3, CpuIsa.AVX2),
    (EPYC_ZEN3 + " avx512f avx512bw avx512vl avx512dq", CpuIsa.AVX512),
    (EPYC_ZEN3 + " avx512f avx512bw avx512vl", CpuIsa.AVX2),  # AVX-512 without DQ is not a level of its own
    (EPYC_ZEN4, CpuIsa.AVX512_BF16),
    (XEON_SPR, CpuIsa.AMX_BF16),
    (EPYC_ZEN3 + " amx_bf16 amx_tile", CpuIsa.AVX2),  # a level needs every level below it
])
def test_detect(text: str, level: CpuIsa) -> None:
    assert detect(flags(text)) == level
    assert supported(flags(text)) == list(CpuIsa)[: level + 1]


def test_evidence_names_what_the_cpu_has_and_the_first_flag_it_lacks() -> None:
    assert evidence(CpuIsa.AVX2, flags(EPYC_ZEN3)) == "cpuinfo: avx2 fma f16c; no avx512f"
    assert evidence(CpuIsa.AVX512_BF16, flags(EPYC_ZEN4)).endswith("avx512_bf16; no amx_tile")
    assert evidence(CpuIsa.AMX_BF16, flags(XEON_SPR)).endswith("amx_tile amx_bf16")
    assert kernel_levels(flags(XEON_SPR)) == [CpuIsa.SCALAR, CpuIsa.AVX2, CpuIsa.AVX512, CpuIsa.AVX512_BF16]


def test_the_environment_lowers_the_level_and_is_refused_above_the_cpu() -> None:
    zen4 = flags(EPYC_ZEN4)
    assert resolve({}, zen4) == (CpuIsa.AVX512_BF16, evidence(CpuIsa.AVX512_BF16, zen4))
    assert resolve({ENV: "avx2"}, zen4) == (CpuIsa.AVX2, f"{ENV} (this CPU offers avx512-bf16)")
    assert resolve({ENV: " AVX512 "}, zen4)[0] == CpuIsa.AVX512
    with pytest.raises(ValueError, match=f"{ENV}=amx-bf16 asks for more than this CPU has .avx512-bf16"):
        resolve({ENV: "amx-bf16"}, zen4)
    with pytest.raises(ValueError, match=f"{ENV}: unknown CPU ISA level 'sse9'; use one of scalar, avx2"):
        resolve({ENV: "sse9"}, zen4)


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda level: level.label)
def test_each_build_has_its_levels_paths(level: CpuIsa) -> None:
    kernels = load(level)
    assert kernels.isa == level and kernels.lib.ladle_isa() == level
    assert load(level).path == kernels.path and len({load(lv).path for lv in kernel_levels()}) == len(kernel_levels())


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda level: level.label)
def test_an_engine_at_each_level_gives_hf_tokens(level: CpuIsa, tiny_qwen3_dir: str, hf_qwen3,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The setting is shown with its source, every linear runs the level's build, and the tokens are HF's."""
    monkeypatch.setenv(ENV, level.label)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # restored afterwards: the engine only sets it where unset
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, max_prefill_length=19)
    setting = llm.config.settings["cpu_isa"]
    native = detect(cpu_flags())
    assert setting.value == level.label and setting.reason.startswith(f"{ENV} (this CPU offers {native.label})")
    assert (level < native) == ("oneDNN capped at AVX2" in setting.reason)
    linears = [m for m in llm.engine.core.model_executor.runner.model.modules() if isinstance(m, CpuLinear)]
    assert linears and {m.kernels.isa for m in linears} == {level}
    rng = random.Random(1)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert ladle_tokens(llm, prompts, params) == [hf_greedy(hf_qwen3, p, 12) for p in prompts]
