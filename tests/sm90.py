"""Compiling Triton kernels for Hopper (sm_90, the H200) without a GPU: Triton lowers to PTX and runs its
bundled ptxas, which catches what the interpreter cannot (types of loop-carried values, constexpr misuse,
layouts). In a subprocess, because the kernel tests set TRITON_INTERPRET=1, which turns every kernel
decorated afterwards into an interpreted one."""
import os
import subprocess
import sys

import pytest

# Each script gets build(kernel, types, consts, **options) -> the compiled kernel, asserting a cubin exists.
PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(kernel, types, consts, **options):
    sig = dict(types, **{name: "constexpr" for name in consts})
    constexprs = {(kernel.arg_names.index(name),): value for name, value in consts.items()}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
    assert "cubin" in compiled.asm, "ptxas produced no cubin"
    return compiled
"""


def compile_for_sm90(script: str) -> None:
    """Run PRELUDE + script in a fresh interpreter; it must print 'compiled for sm_90' at its end."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled for sm_90" in proc.stdout
