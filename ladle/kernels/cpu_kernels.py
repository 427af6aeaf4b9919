"""ladle's C kernels for CPU (ladle/kernels/cpu/*.c), compiled on first use and loaded through ctypes.

Where torch has no fast path for a shape (decode attention reads a few rows against a long paged context:
gathering it and calling a matmul or the flash kernel runs at a fraction of memory bandwidth), a small C loop
does, as vLLM's CPU backend does in its own C++. The library is built with the system C compiler for this
machine (-march=native, less what a lower instruction-set level leaves out: ladle.kernels.cpu_isa) into a cache
keyed by the source, flags, compiler and CPU, so only the first start pays for it (a few seconds a level). It
links OpenMP by soname, so inside a process where torch has loaded its libgomp the kernels run on torch's thread
team (and the binding ladle.startup.threads gave it).

Location: $LADLE_KERNEL_CACHE_DIR, else $XDG_CACHE_HOME/ladle/kernels (~/.cache/ladle/kernels).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ladle.kernels.cpu_isa import CpuIsa, compile_flags, resolve
from ladle.paths import cache_dir

SOURCES = ("isa.c", "decode_attention.c", "skinny_linear.c", "fp8_linear.c", "mxfp4_linear.c", "ggml_linear.c",
           "norm_rope.c", "apply_bitmask.c")
# No contraction of a * b + c into one fma: each product and sum rounds as torch's separate ops round.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here; the message says why (the torch path runs instead)."""


def _cpu_signature() -> bytes:
    """What -march=native compiles for: the CPU's model name and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    return "".join(sorted({line for line in lines if line.startswith(("model name", "flags"))})).encode()


def build(isa: CpuIsa, compiler: str | None = None) -> Path:
    """The compiled library's path for the given level, building it if this source, level, compiler and CPU have
    none cached yet."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler found (install gcc, or set CC)")
    src_dir = Path(__file__).resolve().parent / "cpu"
    sources = [src_dir / name for name in SOURCES]
    headers = sorted(src_dir.glob("*.h"))
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C compiler {cc!r} does not run: {e}") from None
    flags = (*FLAGS, *compile_flags(isa))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources + headers) + " ".join(flags).encode()
                         + version.encode() + _cpu_signature()).hexdigest()[:20]
    target = cache_dir("kernels", "LADLE_KERNEL_CACHE_DIR") / f"ladle_cpu_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place, so concurrent starts never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp, "-lm"], capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            raise KernelUnavailable(f"compiling the CPU kernels failed: {out.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CpuKernels:
    """The loaded library, its functions typed; isa: the level it was built for (its vector paths)."""

    def __init__(self, path: Path, isa: CpuIsa) -> None:
        try:
            self.lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise KernelUnavailable(f"cannot load {path}: {e}") from None
        self.path = path
        # AMX is oneDNN's (torch's matmuls): the kernels' own paths stop at AVX-512 BF16.
        self.lib.ladle_isa.argtypes, self.lib.ladle_isa.restype = [], ctypes.c_int
        built = CpuIsa(self.lib.ladle_isa())
        if built != min(isa, CpuIsa.AVX512_BF16):
            raise KernelUnavailable(f"the kernels built for {isa.label} have the {built.label} paths (a compiler "
                                    f"older than this CPU?); set LADLE_CPU_ISA={built.label}, or a newer CC")
        self.isa = isa
        f32, flag, status = ctypes.c_float, ctypes.c_int, ctypes.c_int  # status: 0, or -1 out of memory
        self.paged_decode_attention = self._typed(
            "paged_decode_attention",
            [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, f32, _i64, flag, flag],
            status)
        self.paged_write_kv = self._typed("paged_write_kv", [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                                             _i64], status)
        self.skinny_linear = self._typed("skinny_linear", [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, flag, flag],
                                         status)
        self.fp8_linear = self._typed("fp8_linear", [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, flag,
                                                     flag], status)
        self.fp8_dequantize = self._typed("fp8_dequantize", [_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, flag, flag])
        self.mxfp4_dequantize = self._typed("mxfp4_dequantize", [_ptr, _ptr, _ptr, _i64, _i64, flag, flag])
        self.mxfp4_linear = self._typed("mxfp4_linear", [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, flag, flag], status)
        self.ggml_linear = self._typed("ggml_linear", [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, flag, flag, flag],
                                       status)
        self.ggml_dequantize = self._typed("ggml_dequantize", [_ptr, _ptr, _i64, _i64, flag, flag, flag])
        self.rms_norm = self._typed("rms_norm", [_ptr, _i64, _ptr, _ptr, _i64, _i64, f32, flag, flag])
        self.add_rms_norm = self._typed("add_rms_norm", [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, f32, flag, flag])
        self.norm_rope = self._typed("norm_rope",
                                     [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, f32, flag, flag])
        self.apply_bitmask = self._typed("apply_bitmask", [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64])

    def _typed(self, name: str, argtypes: list, restype: type | None = None) -> Callable[..., int | None]:
        fn = getattr(self.lib, name)
        fn.argtypes, fn.restype = argtypes, restype
        return fn


def load(isa: CpuIsa | None = None) -> CpuKernels:
    """Build (if needed) and load the kernels for the given level, by default this process's (cpu_isa.resolve:
    $LADLE_CPU_ISA, else the CPU's own); raises KernelUnavailable saying why not."""
    level = resolve()[0] if isa is None else isa
    return CpuKernels(build(level), level)
