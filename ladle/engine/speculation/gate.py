"""Whether a decode row's drafts pay for themselves this step: speculation only while measured acceptance makes
it pay, so a workload the drafts miss runs as fast as without them (issue: n-gram lookup is 1.4-1.8x slower
at high load in vLLM when ungated).

Two measurements, both online:
- each request's acceptance per draft position, p (accepted / positions tried: a rejection ends a row's
  run), shrunk toward the engine-wide rate while the request has few trials and decayed so it follows change;
- the cost of a decode step's tokens, ms = a + b * tokens, least squares over recent decode-only steps (decayed).
A row with k drafts is expected to gain p + p^2 + ... + p^k tokens, each worth a decode token's share of a
plain step, (a + b * rows) / rows, and to cost b * k: it drafts when the gain is worth more (until the fit has
seen two step sizes, every row may draft; ladle.engine.speculation.arms runs plain steps too). A row whose
drafts the gate refuses still drafts one token after PROBE_EVERY refusals, then after twice as many, up to
MAX_BACKOFF, so its p can recover while the probes cost a step almost nothing (16 rows probing every 16 steps
with 5 drafts made a batch-16 step a quarter slower).
"""
from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.95  # weight of the past per observation
PRIOR_TRIALS = 2.0  # a request's rate starts as this many trials at the engine-wide rate
PROBE_EVERY = 16
MAX_BACKOFF = 512
MIN_STEPS = 8.0  # decayed decode-only steps the cost fit needs (two sizes among them) before it is trusted


@dataclass
class _Rate:
    accepted: float = 0.0
    trials: float = 0.0
    refused: int = 0  # refusals since the last draft let through
    backoff: int = PROBE_EVERY  # refusals before the next one-token probe


def expected_accepted(p: float, k: int) -> float:
    """E[accepted drafts] when each position is accepted with probability p until the first rejection."""
    return sum(p**j for j in range(1, k + 1))


class SpecGate:
    def __init__(self) -> None:
        self._rates: dict[str, _Rate] = {}
        self._global = _Rate(1.0, 2.0)  # an even prior until the engine has seen drafts verified
        # Decayed sums of the decode-only steps' (tokens, ms): n, x, y, xx, xy; and the smallest and largest
        # step sizes seen.
        self._sums = [0.0] * 5
        self._sizes = (0, 0)

    def record_step(self, num_tokens: int, ms: float) -> None:
        """A decode-only step of num_tokens tokens (drafts included) took ms."""
        s = self._sums
        for i, v in enumerate((1.0, num_tokens, ms, num_tokens * num_tokens, num_tokens * ms)):
            s[i] = s[i] * DECAY + v
        lo, hi = self._sizes
        self._sizes = (min(lo, num_tokens) if lo else num_tokens, max(hi, num_tokens))

    def cost(self) -> tuple[float, float] | None:
        """(a, b) of ms = a + b * tokens, or None until two step sizes have been measured."""
        n, x, y, xx, xy = self._sums
        var = n * xx - x * x
        if n < MIN_STEPS or self._sizes[0] == self._sizes[1] or var <= 1e-9 * n * n:
            return None
        b = max(0.0, (n * xy - x * y) / var)
        return max(0.0, (y - b * x) / n), b

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """A row with drafted drafts had its first accepted ones accepted."""
        trials = accepted + (accepted < drafted)
        for rate in (self._rates.setdefault(request_id, _Rate()), self._global):
            rate.accepted = rate.accepted * DECAY + accepted
            rate.trials = rate.trials * DECAY + trials

    def rate(self, request_id: str) -> float:
        own = self._rates.get(request_id) or _Rate()
        prior = self._global.accepted / max(self._global.trials, 1e-9)
        return (own.accepted + PRIOR_TRIALS * prior) / (own.trials + PRIOR_TRIALS)

    def forget(self, request_id: str) -> None:
        self._rates.pop(request_id, None)

    def allows(self, request_id: str, k: int, rows: int) -> int:
        """How many of k drafts the row may carry in a step of `rows` decode rows (0: none)."""
        fit = self.cost()
        if fit is None:
            return k
        a, b = fit
        p = self.rate(request_id)
        per_token = (a + b * rows) / rows
        # The best k' <= k: the gain of each further draft shrinks geometrically, its cost does not.
        best, best_net = 0, 0.0
        for j in range(1, k + 1):
            net = expected_accepted(p, j) * per_token - b * j
            if net > best_net:
                best, best_net = j, net
        rate = self._rates.setdefault(request_id, _Rate())
        if best:
            rate.refused, rate.backoff = 0, PROBE_EVERY
            return best
        rate.refused += 1
        if rate.refused >= rate.backoff:
            rate.refused, rate.backoff = 0, min(2 * rate.backoff, MAX_BACKOFF)
            return 1
        return 0
