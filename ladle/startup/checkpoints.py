"""How many state checkpoints a model with per-request state keeps for prefix hits, and how far apart
(ladle.kv_cache.state_checkpoints). Both are reserved in the memory plan before the KV pool is sized."""
from __future__ import annotations

from ladle.config.engine_args import EngineArgs
from ladle.config.provenance import Provenance
from ladle.config.sizes import format_bytes
from ladle.kv_cache.specs import KVCacheLayout

PER_REQUEST = 4  # derived: checkpoints per running request (a conversation's last turns)
SHARE = 16  # derived: at most this fraction of what the weights leave


def resolve_checkpoints(args: EngineArgs, prov: Provenance, layout: KVCacheLayout, budget: int, weights: int,
                        prefix_caching: bool) -> tuple[int, bool]:
    """(num_state_checkpoints, enable_prefix_caching). Explicit values are honoured (the plan refuses a count
    that does not fit) or refused where they cannot apply; the defaults are derived, with the reason."""
    needs = bool(layout.state_groups or layout.tail_groups)
    named = [n for n in ("num_state_checkpoints", "state_checkpoint_interval") if n in prov.explicit]
    if not needs:
        if named:
            raise ValueError(f"{named[0]} applies to models with per-request state (Gated DeltaNet, DeepSeek-V4's "
                             "compressors); this model keeps none: drop it")
        return 0, prefix_caching
    if not prefix_caching:
        if named:
            raise ValueError(f"{named[0]} serves prefix caching, which is off: drop it or enable prefix caching")
        return 0, False
    each = layout.checkpoint_bytes(layout.block_size)
    if "num_state_checkpoints" in prov.explicit:
        return prov.put("num_state_checkpoints", args.num_state_checkpoints), True
    most = max(0, budget - weights) // SHARE // each
    count = min(PER_REQUEST * args.max_num_seqs, most)
    if count < 1:
        why = (f"one state checkpoint ({format_bytes(each)}) does not fit in a 1/{SHARE} of the memory the weights "
               "leave, and a prefix hit on this model must restore its state from one")
        for name in ("enable_prefix_caching", *named):
            if name in prov.explicit:
                raise ValueError(f"{name} cannot be used here: {why}; drop it or raise memory_budget")
        prov.put("enable_prefix_caching", False, why)
        return 0, False
    why = (f"{PER_REQUEST} per running request" if count == PER_REQUEST * args.max_num_seqs else
           f"what 1/{SHARE} of the memory the weights leave holds")
    return prov.put("num_state_checkpoints", count, f"{why}, {format_bytes(each)} each"), True


def resolve_interval(args: EngineArgs, prov: Provenance, chunk: int, num_checkpoints: int) -> int:
    """Tokens between checkpoints while a request prefills: by default the chunk cap in whole blocks, so a lone
    prompt's chunks end on them and checkpointing costs no extra step."""
    if not num_checkpoints:
        return args.state_checkpoint_interval or 0
    if "state_checkpoint_interval" in prov.explicit:
        return prov.put("state_checkpoint_interval", args.state_checkpoint_interval)
    size = args.block_size
    return prov.put("state_checkpoint_interval", max(size, chunk // size * size),
                    "the chunk cap in whole blocks: a lone prompt's chunks end on checkpoints")
