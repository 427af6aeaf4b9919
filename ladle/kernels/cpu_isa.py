"""The x86 instruction-set level ladle's CPU paths run at: detected once from /proc/cpuinfo, lowered on request.

x86 CPUs differ in what ladle's kernels can use: AVX2 with FMA (every x86 server of the last decade), AVX-512
(F, BW, VL, DQ: wider vectors), AVX-512 BF16 (bf16 dot products, the fast decode read of a bf16 weight; oneDNN
then runs torch's bf16 matmuls natively) and AMX (bf16 tile multiplies, which oneDNN uses for prefill GEMMs).
The C kernels are compiled per level (`-march=native` less what the level leaves out), so one machine can run
every level below its own: tests check each path the machine executes, and a benchmark compares them side by
side. `LADLE_CPU_ISA` (like torch's `ATEN_CPU_CAPABILITY` and oneDNN's `ONEDNN_MAX_CPU_ISA`) forces a lower
level for a process; the engine shows the level in its settings table with where it came from.
"""
from __future__ import annotations

import enum
import os
import platform
from collections.abc import Mapping
from pathlib import Path

ENV = "LADLE_CPU_ISA"


class CpuIsa(enum.IntEnum):
    """Ordered: a level includes every one below it."""

    SCALAR = 0
    AVX2 = 1
    AVX512 = 2
    AVX512_BF16 = 3
    AMX_BF16 = 4

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, text: str) -> CpuIsa:
        for level in cls:
            if text.strip().lower() in (level.label, level.name.lower()):
                return level
        raise ValueError(f"unknown CPU ISA level {text!r}; use one of {', '.join(lv.label for lv in cls)}")


# The cpuinfo flags each level adds to the one below it.
_NEEDS: dict[CpuIsa, tuple[str, ...]] = {
    CpuIsa.SCALAR: (),
    CpuIsa.AVX2: ("avx2", "fma", "f16c"),
    CpuIsa.AVX512: ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    CpuIsa.AVX512_BF16: ("avx512_bf16",),
    CpuIsa.AMX_BF16: ("amx_tile", "amx_bf16"),
}

# What -march=native loses at each level: GCC and clang drop every extension that depends on a dropped one.
_COMPILE_FLAGS: dict[CpuIsa, tuple[str, ...]] = {
    CpuIsa.SCALAR: ("-mno-avx",),
    CpuIsa.AVX2: ("-mno-avx512f",),
    CpuIsa.AVX512: ("-mno-avx512bf16",),
    CpuIsa.AVX512_BF16: (),
    CpuIsa.AMX_BF16: (),
}



def compile_flags(level: CpuIsa) -> tuple[str, ...]:
    """The compiler flags that hold a -march=native build to `level` (none off x86, where every level is the
    scalar one)."""
    return _COMPILE_FLAGS[level] if platform.machine() in ("x86_64", "AMD64") else ()


# oneDNN's names for the same caps (its ONEDNN_MAX_CPU_ISA), so torch's matmuls drop with ladle's kernels.
ONEDNN_CAPS: dict[CpuIsa, str] = {
    CpuIsa.SCALAR: "SSE41",
    CpuIsa.AVX2: "AVX2",
    CpuIsa.AVX512: "AVX512_CORE_VNNI",
    CpuIsa.AVX512_BF16: "AVX512_CORE_BF16",
    CpuIsa.AMX_BF16: "AVX512_CORE_AMX",
}


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo (or of the given text); empty where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def detect(flags: frozenset[str]) -> CpuIsa:
    """The highest level whose flags (its own and every lower level's) the CPU has."""
    best = CpuIsa.SCALAR
    for level in CpuIsa:
        if not set(_NEEDS[level]) <= flags:
            break
        best = level
    return best


def supported(flags: frozenset[str]) -> list[CpuIsa]:
    """Every level this CPU can run, lowest first."""
    return list(CpuIsa)[: detect(flags) + 1]


def kernel_levels(flags: frozenset[str] | None = None) -> list[CpuIsa]:
    """The distinct builds of ladle's C kernels this CPU can run, lowest first (AMX adds nothing to them: it is
    oneDNN's, for torch's matmuls)."""
    return [lv for lv in supported(cpu_flags() if flags is None else flags) if lv <= CpuIsa.AVX512_BF16]


def evidence(level: CpuIsa, flags: frozenset[str]) -> str:
    """Why the CPU is at `level`: the flags it has, and the first it lacks for the next level."""
    have = [f for lv in CpuIsa if 0 < lv <= level for f in _NEEDS[lv]]
    text = "cpuinfo: " + (" ".join(have) if have else "no avx2/fma")
    if level < CpuIsa.AMX_BF16:
        missing = [f for f in _NEEDS[CpuIsa(level + 1)] if f not in flags]
        text += f"; no {missing[0]}"
    return text


def resolve(environ: Mapping[str, str] | None = None, flags: frozenset[str] | None = None) -> tuple[CpuIsa, str]:
    """The level this process runs at and why: $LADLE_CPU_ISA where set (refused above what the CPU has), else
    the CPU's own."""
    environ = os.environ if environ is None else environ
    flags = cpu_flags() if flags is None else flags
    native = detect(flags)
    asked = environ.get(ENV, "").strip()
    if not asked:
        return native, evidence(native, flags)
    try:
        level = CpuIsa.parse(asked)
    except ValueError as e:
        raise ValueError(f"{ENV}: {e}") from None
    if level > native:
        raise ValueError(f"{ENV}={asked} asks for more than this CPU has ({native.label}: {evidence(native, flags)}); "
                         f"set it to {native.label} or lower, or unset it")
    return level, f"{ENV} (this CPU offers {native.label})"
