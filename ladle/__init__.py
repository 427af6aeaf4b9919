"""ladle: LLM inference whose every prefill is split into memory-bounded chunks.

The public names load on first use, so that `import ladle.engine...` (the engine process, `ladle plan`) does
not pay for the offline frontend's imports.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
_HOMES = {"LLM": "ladle.entrypoints.llm", "SamplingParams": "ladle.sampling_params",
          "RequestOutput": "ladle.outputs", "CompletionOutput": "ladle.outputs", "Logprob": "ladle.outputs"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'ladle' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
