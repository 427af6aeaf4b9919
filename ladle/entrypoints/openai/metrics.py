"""Prometheus metrics of the OpenAI server (vLLM's names, with the `ladle:` prefix).

Engine counters restart from zero with each engine process; Prometheus counters must not go back, so the
server keeps its own counters and adds each snapshot's increase over the last one of the same process.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ladle.engine.core_output import EngineSnapshot

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Snapshot field -> counter name (without the prefix and _total).
_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens computed (recomputation after preemption included)."),
    "generation_tokens": ("generation_tokens", "Generated tokens."),
    "num_preemptions": ("num_preemptions", "Requests preempted for lack of KV blocks."),
    "prefill_chunks": ("prefill_chunks", "Prefill chunks run (a long prompt is several)."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "prefix_cache_hit_requests": ("prefix_cache_hit_requests", "Requests admitted with a prefix-cache hit."),
    "state_checkpoints_stored": ("state_checkpoints_stored", "State checkpoints stored for prefix hits (models "
                                                             "with per-request state)."),
    "state_checkpoints_evicted": ("state_checkpoints_evicted", "State checkpoints evicted to make room."),
    "num_steps": ("engine_steps", "Engine steps run."),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Decode rows that carried drafts (speculative decoding)."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    "moe_cache_hits": ("moe_cache_hits", "Tiered MoE experts found in the device's cache slots."),
    "moe_cache_misses": ("moe_cache_misses", "Tiered MoE experts not in the cache (fetched or computed in place)."),
    "moe_bytes_fetched": ("moe_bytes_fetched", "Bytes of tiered experts fetched into the cache."),
    "moe_fetch_seconds": ("moe_fetch_seconds", "Seconds spent fetching tiered experts (ahead of use included)."),
    "moe_fetch_wait_seconds": ("moe_fetch_wait_seconds", "Seconds steps waited for tiered experts to arrive."),
    "moe_prefetched": ("moe_prefetched", "Tiered expert fetches started ahead of their turn."),
    "moe_computed_in_place": ("moe_experts_computed_in_place", "Tiered expert misses computed where they live."),
    "kv_offload_demoted_blocks": ("kv_offload_demoted_blocks", "Cached KV blocks the device pool evicted into the "
                                                               "host tier (kv_offloading_size)."),
    "kv_offload_promoted_blocks": ("kv_offload_promoted_blocks", "Prefix-cache hits served from the host tier, in "
                                                                 "blocks copied back to the device."),
    "kv_offload_promoted_bytes": ("kv_offload_promoted_bytes", "Bytes copied back from the host tier for hits."),
    "kv_offload_dropped_blocks": ("kv_offload_dropped_blocks", "Host-tier blocks dropped to make room (least "
                                                               "recently used first)."),
    "kv_disk_stored_blocks": ("kv_disk_stored_blocks", "Cached KV blocks and state checkpoints written to the disk "
                                                       "tier (kv_disk_cache_dir)."),
    "kv_disk_loaded_blocks": ("kv_disk_loaded_blocks", "Blocks and state checkpoints read back from the disk tier "
                                                       "for prefix hits."),
    "kv_disk_misses": ("kv_disk_misses", "Disk-tier entries refused by a check on read (torn, truncated, stale or "
                                         "foreign): their tokens were computed instead."),
    "kv_disk_evicted_blocks": ("kv_disk_evicted_blocks", "Disk-tier entries deleted to stay within "
                                                         "kv_disk_cache_size (least recently used first)."),
    "steps_with_lent_cpus": ("engine_steps_with_lent_cpus", "Engine steps run with the API process's idle CPUs "
                                                            "lent (ladle serve on CPU)."),
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"ladle:{name}", doc, labelnames=list(labels), registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"ladle:{name}", doc, labelnames=list(labels), buckets=buckets,
                             registry=r).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running set.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.state_checkpoint_bytes = gauge("state_checkpoint_bytes", "Bytes held by registered state checkpoints.")
        self.kv_blocks_in_use = gauge("kv_blocks_in_use", "KV blocks in use.")
        self.prefix_cache_sessions = gauge("prefix_cache_sessions", "Sessions (prompt_cache_key, metadata.user_id, "
                                           "session headers) whose prefixes the cache keeps for their next turn.")
        self.prefix_cache_kept_nodes = gauge("prefix_cache_kept_nodes", "Prefix-cache blocks of tokens the live "
                                             "sessions keep (evicted after every other).")
        self.engine_healthy = gauge("engine_healthy", "1 while the engine process is up and serving.")
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"ladle:{name}", doc, labelnames=list(labels), registry=r).labels(**labels)

        self.engine_restarts = counter("engine_restarts", "Engine process restarts by the supervisor.")
        self.connections_refused = counter("http_connections_refused", "Connections answered 503 and closed past "
                                                                       "--max-connections.")
        self.head_timeouts = counter("http_request_head_timeouts", "Connections closed for sending no whole request "
                                                                   "head within --timeout-request-head.")
        self.stalled_responses = counter("http_stalled_responses", "Responses aborted because the client took none "
                                                                   "of their bytes for --stream-stall-timeout.")
        self.counters = {field: counter(name, doc) for field, (name, doc) in _COUNTERS.items()}
        self.request_success = Counter("ladle:request_success", "Finished choices by finish reason.",
                                       labelnames=[*labels, "finished_reason"], registry=r)
        self.api_requests = Counter("ladle:api_requests", "Requests accepted, by API (chat_completions, "
                                    "completions, messages, responses).", labelnames=[*labels, "api"], registry=r)
        self.structured_requests = counter("structured_output_requests", "Requests under a structured-output "
                                           "constraint: a schema, regex, choice or grammar, or a forced tool call.")
        self.tool_calls = counter("tool_calls", "Tool calls read from replies by the tool-call parser.")
        self.no_op_fields = Counter("ladle:no_op_fields", "Request fields taken without effect, by API and field: "
                                    "hints that cannot change what the model sees or generates (the README's "
                                    "table).", labelnames=[*labels, "api", "field"], registry=r)
        self.model_name = model_name
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to the first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between tokens of a choice.",
                                             _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to the last token.",
                                             _E2E_BUCKETS)
        self._generation = 0
        self._last = EngineSnapshot()
        self._restarts_seen = 0

    def on_snapshot(self, generation: int, snap: EngineSnapshot) -> None:
        if generation != self._generation:
            self._generation, self._last = generation, EngineSnapshot()
        for field, counter in self.counters.items():
            increase = getattr(snap, field) - getattr(self._last, field)
            if increase > 0:
                counter.inc(increase)
        self._last = snap
        self.num_requests_running.set(snap.num_running)
        self.num_requests_waiting.set(snap.num_waiting)
        self.kv_blocks_in_use.set(snap.kv_blocks_in_use)
        self.kv_cache_usage_perc.set(snap.kv_usage)
        self.state_checkpoint_bytes.set(snap.state_checkpoint_bytes)
        self.prefix_cache_sessions.set(snap.prefix_cache_sessions)
        self.prefix_cache_kept_nodes.set(snap.prefix_cache_kept_nodes)

    def set_engine(self, healthy: bool, num_restarts: int) -> None:
        self.engine_healthy.set(1 if healthy else 0)
        increase = num_restarts - self._restarts_seen
        if increase > 0:
            self.engine_restarts.inc(increase)
        self._restarts_seen = num_restarts

    def accepted(self, api: str, constrained: bool) -> None:
        self.api_requests.labels(model_name=self.model_name, api=api).inc()
        if constrained:
            self.structured_requests.inc()

    def no_ops(self, api: str, fields: list[str]) -> None:
        for field in fields:
            self.no_op_fields.labels(model_name=self.model_name, api=api, field=field).inc()

    def finished(self, reason: str) -> None:
        self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
