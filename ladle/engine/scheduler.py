"""Token-budget scheduler with chunked prefill (Sarathi-style order, vLLM v1-style accounting).

Each step serves, within max_num_batched_tokens: running decodes first, then running partial prefills,
then waiting requests FCFS. Every prefill chunk is min(remaining, max_prefill_length, remaining budget),
so no forward call sees more tokens than the budget and no request more than its chunk cap.

With prefix caching, an admitted request starts at its cache hit (num_computed_tokens = hit tokens), and
admission counts only the blocks it will take from the free queue.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace

from ladle.config import EngineConfig
from ladle.kv_cache.manager import KVCacheManager
from ladle.request import Request, RequestRejected, RequestStatus

logger = logging.getLogger("ladle.scheduler")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start_pos: int  # num_computed_tokens when scheduled
    num_new_tokens: int
    is_prefill: bool  # a (re)prefill chunk rather than one decode token

    @property
    def samples(self) -> bool:
        """A token is sampled only when this chunk reaches the end of the request's known tokens."""
        return self.start_pos + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    prefix_cache_queries: int = 0  # tokens of the requests admitted this step, looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from the cache

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if not s.is_prefill)

    @property
    def num_prefill_chunks(self) -> int:
        return len(self.scheduled) - self.num_decodes

    def shrink(self, max_tokens: int) -> "SchedulerOutput":
        """The same step cut to max_tokens tokens, in schedule order (decodes first). A request cut short
        or dropped simply has fewer tokens computed this step; its blocks and slots stay as they were."""
        kept, left = [], max_tokens
        for s in self.scheduled:
            n = min(s.num_new_tokens, left)
            if n > 0:
                kept.append(replace(s, num_new_tokens=n))
                left -= n
        return replace(self, scheduled=kept)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self.num_preemptions = 0

    def check(self, request: Request) -> None:
        """Reject now what could never run, so it never waits at the head of the queue."""
        cfg = self.config
        total = request.num_prompt_tokens + request.max_tokens
        if total > cfg.max_model_len:
            raise RequestRejected(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = {total} "
                f"exceeds max_model_len={cfg.max_model_len}; shorten the prompt or lower max_tokens",
                code="context_length_exceeded",
            )
        need = self.kv.peak_blocks(total, min(cfg.max_prefill_length, cfg.max_num_batched_tokens))
        if need > self.kv.num_blocks:
            raise RequestRejected(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) needs {need} "
                f"KV blocks of {cfg.block_size} tokens, but the whole pool has {self.kv.num_blocks} "
                f"({self.kv.num_blocks * cfg.block_size} tokens); raise num_kv_blocks or lower max_tokens",
                code="kv_cache_too_small",
            )

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            (prefills if r.is_prefilling else decodes).append(r)
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            n = self._chunk(req, budget)
            if not self._reserve(req, n, scheduled_ids, out):
                continue
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n, req.is_prefilling))
            scheduled_ids.add(req.request_id)
            budget -= n
        # A step that preempted is short of blocks: admitting now would only thrash.
        deferred: list[Request] = []
        while budget > 0 and self.waiting and not out.preempted_ids and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(req)
            if self._prefix_in_flight(req, num_cached):
                deferred.append(self.waiting.popleft())
                continue
            # Admission on the whole (re)prefill, so an admitted prompt never stalls between chunks. Cached
            # blocks cost only what taking them out of the free queue costs.
            chunk = min(self.config.max_prefill_length, self.config.max_num_batched_tokens)
            first_end = num_cached + min(req.num_tokens - num_cached, chunk, budget)
            if not self.kv.admit(req.request_id, req.num_tokens, first_end, chunk, computed_blocks, num_cached):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            if self.kv.enable_caching:
                out.prefix_cache_queries += req.num_tokens
                out.prefix_cache_hits += num_cached
                logger.debug("admitted request=%s prefix_cache_hit=%d of %d tokens", req.request_id, num_cached,
                             req.num_tokens)
            self.running.append(req)
            n = self._chunk(req, budget)
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n, is_prefill=True))
            scheduled_ids.add(req.request_id)
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # they keep their place in the queue
        for s in out.scheduled:
            if s.is_prefill:
                self._log_chunk(s)
        return out

    def schedule_ahead(self, sched: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `sched`, scheduled before sched's tokens are known (async scheduling): the same
        decodes one token further. None unless that is exactly what schedule() would return once they are
        known: every running request is a decode of sched, none finishes by length at sched, no waiting
        request could be admitted, and the pool has every block the next tokens need (allocated here) without
        preempting anyone. A request that stops on a token at sched has its step-ahead result dropped."""
        if sched.preempted_ids or len(sched.scheduled) != len(self.running) or self.kv.has_sliding_window:
            return None  # (a window would give blocks back under the step in flight: run synchronously)
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return None
        for s in sched.scheduled:
            req = s.request
            if s.is_prefill or s.num_new_tokens != 1 or req.status is not RequestStatus.RUNNING:
                return None
            if req.num_output_tokens + 2 > req.max_tokens or req.num_tokens + 2 > self.config.max_model_len:
                return None
        need = sum(self.kv.num_blocks_to_allocate(s.request.request_id, s.start_pos + 2) for s in sched.scheduled)
        if need > self.kv.num_free_blocks:
            return None
        for s in sched.scheduled:
            allocated = self.kv.allocate(s.request.request_id, s.start_pos + 2)
            assert allocated, "free blocks were counted above"
        return SchedulerOutput([ScheduledRequest(s.request, s.start_pos + 1, 1, False) for s in sched.scheduled])

    def _prefix_in_flight(self, req: Request, num_cached: int) -> bool:
        """True when a running request has yet to write the next block of req's prefix that req could reuse.

        Waiting for it (one step, or until that request's chunked prefill passes the block) beats computing
        the same KV twice. This is how n > 1 siblings, admitted together, share their prompt: the first
        prefills it, the others follow a step later and hit its blocks. Requests behind a deferred one may
        be admitted meanwhile; the deferred one keeps its place at the head of the queue.
        """
        if not self.kv.enable_caching:
            return False
        end = num_cached + self.kv.block_size
        if end > req.num_tokens - 1:
            return False  # no further block of req would be reused: a hit stops before the last token
        tokens = req.all_token_ids
        for other in self.running:
            ids = other.all_token_ids
            if (other.num_computed_tokens < end <= len(ids) and ids[num_cached:end] == tokens[num_cached:end]
                    and ids[:num_cached] == tokens[:num_cached]):
                return True
        return False

    def _chunk(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        if req.is_prefilling:
            return min(remaining, self.config.max_prefill_length, budget)
        return min(remaining, budget)

    def _reserve(self, req: Request, n: int, scheduled_ids: set[str], out: SchedulerOutput) -> bool:
        """Make room for n more tokens of req, preempting the newest unscheduled requests if needed."""
        while not self.kv.allocate(req.request_id, req.num_computed_tokens + n, num_computed=req.num_computed_tokens):
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled_ids)
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def restart(self, reqs: list[Request]) -> None:
        """Recompute these running requests from their first token, ahead of the queue in their order (their
        per-request state was lost in a failed step)."""
        for req in reversed(reqs):
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the generated tokens, go to the front of the queue."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (%d tokens to recompute)", req.request_id, req.num_tokens)

    def _log_chunk(self, s: ScheduledRequest) -> None:
        req = s.request
        remaining = req.num_tokens - s.start_pos
        logger.debug(
            "prefill chunk request=%s chunk_size=%d remain=%d cached=%d budget=%d chunked=%s",
            req.request_id, s.num_new_tokens, remaining, s.start_pos,
            min(self.config.max_prefill_length, self.config.max_num_batched_tokens),
            s.num_new_tokens < remaining,
        )

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)

    def find(self, request_id: str) -> Request | None:
        for req in self.running:
            if req.request_id == request_id:
                return req
        for req in self.waiting:
            if req.request_id == request_id:
                return req
        return None
