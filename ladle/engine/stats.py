"""Counters the core keeps so tests and --profile read facts, not logs."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from ladle.experts.cache import ExpertCacheStats

# Per-step records kept for --profile and tests; a long-running server keeps only the latest ones.
MAX_STEP_RECORDS = 100_000


@dataclass(frozen=True)
class StepRecord:
    step: int
    num_tokens: int
    num_prefill_chunks: int
    num_decodes: int
    num_preempted: int
    ms: float
    moe_fetch_ms: float = 0.0  # tiered experts: time this step's expert fetches took (ahead, on the fetch thread, too)
    moe_wait_ms: float = 0.0  # of it, the time the step's layers waited for their experts


@dataclass
class EngineStats:
    steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=MAX_STEP_RECORDS))
    num_steps: int = 0
    num_prefill_chunks: int = 0
    max_step_tokens: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens computed, recomputation after preemption included
    generation_tokens: int = 0
    oom_retries: int = 0  # steps run again with half the tokens after running out of memory
    isolation_retries: int = 0  # steps split in halves after an exception, to find the request that fails
    state_restarts: int = 0  # failed steps whose requests restarted, their per-request state lost
    requests_failed: int = 0  # requests ended with an error so the engine could keep serving the others
    steps_ahead: int = 0  # async scheduling: decode steps launched before their predecessor's tokens were read
    tokens_dropped: int = 0  # of their tokens, those for requests that stopped or were aborted meanwhile
    steps_with_lent_cpus: int = 0  # steps that ran with the API process's idle CPUs lent (cpu_lending.py)
    # In tokens, as vLLM counts them: queries are all tokens of each admitted request (again after a
    # preemption), hits those served by the prefix cache. Zero when prefix caching is off.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_requests: int = 0  # admissions that resumed from a hit
    # Models with per-request state: checkpoints registered and evicted so far, and the bytes held now.
    state_checkpoints_stored: int = 0
    state_checkpoints_evicted: int = 0
    state_checkpoint_bytes: int = 0
    # Speculative decoding, as vLLM counts it: decode rows that carried drafts, their drafts, those accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Tiered MoE experts (ladle.experts): the cache's own counters, from the engine's start (None: no tiering).
    experts: ExpertCacheStats | None = None
    _fetch_seen: tuple[float, float] = (0.0, 0.0)  # the experts' fetch and wait seconds at the last step

    def counters(self) -> dict[str, Any]:
        """The counters a snapshot reports, by EngineSnapshot's names."""
        names = ("num_preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                 "prefix_cache_hit_requests", "state_checkpoints_stored", "state_checkpoints_evicted",
                 "state_checkpoint_bytes", "num_steps", "steps_with_lent_cpus", "spec_decode_num_drafts",
                 "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        out: dict[str, Any] = {n: getattr(self, n) for n in names} | {"prefill_chunks": self.num_prefill_chunks}
        e = self.experts
        if e is not None:
            out |= {"moe_cache_hits": e.hits, "moe_cache_misses": e.misses, "moe_bytes_fetched": e.bytes_fetched,
                    "moe_fetch_seconds": e.fetch_seconds, "moe_fetch_wait_seconds": e.wait_seconds,
                    "moe_computed_in_place": e.computed_in_place, "moe_prefetched": e.prefetched}
        return out

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens a decode row with drafts produced on average: its accepted drafts and the token it sampled."""
        return 1 + self.spec_decode_num_accepted_tokens / max(1, self.spec_decode_num_drafts)

    def record(self, step: StepRecord) -> None:
        if self.experts is not None:
            now = (self.experts.fetch_seconds, self.experts.wait_seconds)
            step = replace(step, moe_fetch_ms=(now[0] - self._fetch_seen[0]) * 1000,
                           moe_wait_ms=(now[1] - self._fetch_seen[1]) * 1000)
            self._fetch_seen = now
        self.steps.append(step)
        self.num_steps += 1
        self.num_prefill_chunks += step.num_prefill_chunks
        self.max_step_tokens = max(self.max_step_tokens, step.num_tokens)

    def profile_table(self) -> str:
        lines = [f"{'step':>6} {'tokens':>7} {'chunks':>7} {'decodes':>8} {'preempt':>8} {'ms':>9}"]
        for s in self.steps:
            lines.append(
                f"{s.step:>6} {s.num_tokens:>7} {s.num_prefill_chunks:>7} {s.num_decodes:>8} "
                f"{s.num_preempted:>8} {s.ms:>9.2f}"
            )
        total_ms = sum(s.ms for s in self.steps)
        lines.append(f"{self.num_steps} steps, {sum(s.num_tokens for s in self.steps)} tokens, "
                     f"largest step {self.max_step_tokens} tokens, {total_ms / 1000:.2f} s in steps, "
                     f"{self.num_preemptions} preemptions, prefix cache hit {self.prefix_cache_hits} of "
                     f"{self.prefix_cache_queries} tokens")
        return "\n".join(lines)
