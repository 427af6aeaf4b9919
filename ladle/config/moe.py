"""The tiered-experts settings' choices and the checks they need before any model is read (ladle.experts
resolves them against the model and the budget)."""
from __future__ import annotations

MOE_STRATEGIES = ("offload", "cpu", "hybrid")  # ladle.experts.tiered.MissPolicy
MOE_BACKINGS = ("host", "mmap")  # ladle.experts.backing


def validate_moe_args(size: object, fraction: object, strategy: object, backing: object, prefetch: object) -> None:
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"moe_cache_size must be a positive integer, got {size!r}")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0 < fraction <= 1):
        raise ValueError(f"moe_cache_fraction must be in (0, 1] (the share of all routed experts cached), "
                         f"got {fraction!r}")
    if size is not None and fraction is not None:
        raise ValueError("moe_cache_size and moe_cache_fraction both size the expert cache; give one of them")
    if strategy is not None and strategy not in MOE_STRATEGIES:
        raise ValueError(f"moe_strategy={strategy!r}: choose one of {', '.join(MOE_STRATEGIES)}")
    if prefetch is not None and not isinstance(prefetch, bool):
        raise ValueError(f"moe_prefetch={prefetch!r} is not a bool")
    if backing is not None and backing not in MOE_BACKINGS:
        raise ValueError(f"moe_backing={backing!r}: choose one of {', '.join(MOE_BACKINGS)}")
