"""Whether a request could ever run on this engine: checked when it is added, so it never waits at the head of
the queue for what cannot come."""
from __future__ import annotations

from ladle.startup.engine_config import EngineConfig
from ladle.kv_cache.manager import KVCacheManager
from ladle.request import Request, RequestRejected


def check_admissible(request: Request, cfg: EngineConfig, kv: KVCacheManager, policy: str) -> None:
    """Reject now what could never run, so it never waits at the head of the queue."""
    if request.priority != 0 and policy != "priority":
        raise RequestRejected(f"priority={request.priority} needs priority scheduling; this engine runs "
                              f"scheduling_policy={policy!r}: drop priority or start the engine "
                              "with scheduling_policy='priority'")
    total = request.num_prompt_tokens + request.max_tokens
    if total > cfg.max_model_len:
        raise RequestRejected(
            f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = {total} "
            f"exceeds max_model_len={cfg.max_model_len}; shorten the prompt or lower max_tokens",
            code="context_length_exceeded",
        )
    need = kv.peak_blocks(total, min(cfg.max_prefill_length, cfg.max_num_batched_tokens))
    if need > kv.num_blocks:
        raise RequestRejected(
            f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) needs {need} "
            f"KV blocks of {cfg.block_size} tokens, but the whole pool has {kv.num_blocks} "
            f"({kv.num_blocks * cfg.block_size} tokens); raise num_kv_blocks or lower max_tokens",
            code="kv_cache_too_small",
        )
