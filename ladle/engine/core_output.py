"""What the engine core hands its frontends: each request's news after a step, and the core's gauges. Plain
data (no torch), so the server's API process can receive them without importing the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from ladle.outputs import Logprob


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None
    # The last new token is the stop token (or EOS) that ended the request, whose text frontends leave out; a
    # request a complete grammar ended keeps its last token's text.
    stop_token: bool = False
    error: str | None = None
    # With an error: "invalid_grammar" when the request's own structured-output grammar cannot run (a client
    # error the server answers with 400), "expert_file_changed" when a tiered expert it needs cannot be read as
    # loaded (the message names the file), None for a failure of the engine.
    error_code: str | None = None
    num_cached_tokens: int | None = None  # on a request's first token: prompt tokens the prefix cache served
    prefill_chunks: list[int] | None = None  # on a request's last output: its prefill chunks' sizes, in order
    # On a request's first token, with SamplingParams.prompt_logprobs: None, then an entry per prompt position.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    """The core's gauges and cumulative counters, as of one point in the engine loop."""
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_in_use: int = 0
    num_kv_blocks: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_chunks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_requests: int = 0
    state_checkpoints_stored: int = 0
    state_checkpoints_evicted: int = 0
    state_checkpoint_bytes: int = 0
    num_steps: int = 0
    steps_with_lent_cpus: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    moe_cache_hits: int = 0
    moe_cache_misses: int = 0
    moe_bytes_fetched: int = 0
    moe_fetch_seconds: float = 0.0
    moe_fetch_wait_seconds: float = 0.0
    moe_computed_in_place: int = 0
    moe_prefetched: int = 0
    # The prefix cache's host tier (kv_offloading_size): blocks demoted there, promoted back (hits), dropped.
    kv_offload_demoted_blocks: int = 0
    kv_offload_promoted_blocks: int = 0
    kv_offload_promoted_bytes: int = 0
    kv_offload_dropped_blocks: int = 0
    # The disk tier below it (kv_disk_cache_dir): entries (blocks and state checkpoints) written, read back for hits,
    # read and refused by a check (torn, stale, foreign: computed instead), deleted past kv_disk_cache_size.
    kv_disk_stored_blocks: int = 0
    kv_disk_loaded_blocks: int = 0
    kv_disk_misses: int = 0
    kv_disk_evicted_blocks: int = 0
    # Session retention: sessions whose prefixes the cache keeps now, and the prefix nodes they keep.
    prefix_cache_sessions: int = 0
    prefix_cache_kept_nodes: int = 0
    step_running_s: float = 0.0  # in a pong: how long the step under way has run (0 between steps)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_in_use / self.num_kv_blocks if self.num_kv_blocks else 0.0
