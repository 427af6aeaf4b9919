"""--speculative-config, in vLLM's spelling: '{"method": "ngram", "num_speculative_tokens": 3,
"prompt_lookup_max": 4}' or '{"method": "mtp", "num_speculative_tokens": 1}'. Every key is read or refused by
name; nothing is dropped."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "mtp")
# vLLM's older per-model names of the mtp method, read as it reads them.
MTP_ALIASES = ("qwen3_5_mtp", "qwen3_next_mtp", "deepseek_mtp")
# vLLM's names for methods ladle does not run yet: refused by name rather than read as unknown.
PLANNED = ("eagle", "eagle3", "draft_model", "medusa", "suffix")
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # drafts verified per decode row at most (k)
    prompt_lookup_min: int  # ngram: the shortest suffix looked up earlier in the request's tokens
    prompt_lookup_max: int  # ngram: the longest
    disable_by_batch_size: int | None = None  # vLLM's: no drafts while more requests than this run

    def describe(self) -> str:
        text = (f"ngram, k={self.num_speculative_tokens}, n-grams of {self.prompt_lookup_min}-"
                f"{self.prompt_lookup_max} tokens" if self.method == "ngram" else
                f"mtp, k={self.num_speculative_tokens}, drafted by the model's MTP layer")
        return text + (f", off above {self.disable_by_batch_size} running" if self.disable_by_batch_size else "")


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
    return value


def parse_speculative_config(value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """The config from a dict or its JSON text (None: no speculation). Raises ValueError naming what to change."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not JSON ({e}); write e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from e
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: ladle does not read {unknown}; it reads {list(_KEYS)}")
    method = value.get("method")
    if method in PLANNED:
        raise ValueError(f"speculative_config: method {method!r} is not implemented in ladle yet; use 'ngram' or "
                         "'mtp'")
    method = "mtp" if method in MTP_ALIASES else method
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {list(METHODS)}, got {method!r}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required (the drafts per step, e.g. 3)")
    k = _positive("num_speculative_tokens", value["num_speculative_tokens"])
    given = [key for key in _NGRAM_KEYS if key in value]
    if method == "mtp" and given:
        raise ValueError(f"speculative_config: {given} are read by method 'ngram' only; drop them for 'mtp'")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    lo = None if lo is None else _positive("prompt_lookup_min", lo)
    hi = None if hi is None else _positive("prompt_lookup_max", hi)
    lo, hi = (5, 5) if lo is hi is None else (lo or hi, hi or lo)  # vLLM's defaults: one fills in the other
    assert lo is not None and hi is not None
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    off = value.get("disable_by_batch_size")
    return SpeculativeConfig(method, k, lo, hi, None if off is None else _positive("disable_by_batch_size", off))
