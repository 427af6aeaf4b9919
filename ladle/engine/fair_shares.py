"""How a step's prefill budget is split between the partial prefills (the policy: ladle.startup.partial_prefill)."""
from __future__ import annotations


def fair_shares(demands: list[int], budget: int) -> list[int]:
    """Max-min fair split of budget: in ascending order of demand each gets min(demand, an equal share of
    what is left), so nothing is left unused while a demand is unmet."""
    shares = [0] * len(demands)
    left = budget
    order = sorted(range(len(demands)), key=demands.__getitem__)
    for k, i in enumerate(order):
        shares[i] = min(demands[i], left // (len(order) - k))
        left -= shares[i]
    return shares
