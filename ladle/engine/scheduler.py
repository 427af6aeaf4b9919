"""Token-budget scheduler with chunked prefill (Sarathi-style order, vLLM v1-style accounting).

Each step serves, within max_num_batched_tokens: running decodes first, then the prefills, which share what
is left (ladle.startup.partial_prefill): the running partial prefills and waiting requests admitted beside them,
at most max_num_partial_prefills of them and max_long_partial_prefills long ones, each chunk also within
max_prefill_length. So no forward call sees more tokens than the budget, no request more than its chunk cap,
and a long prompt does not keep short ones waiting for its whole prefill.

Waiting requests are served in the scheduling policy's order (ladle.engine.request_queue). Admission takes a
request's whole (re)prefill of KV; one that cannot get it yet is passed over by requests behind it that can,
at most max_pass_over times, after which nothing behind it starts until it does.

With prefix caching, an admitted request starts at its cache hit (num_computed_tokens = hit tokens), and
admission counts only the blocks it will take from the free queue. On a model whose hits need state checkpoints,
a prefill chunk ends at the request's next checkpoint position (ladle.engine.checkpoint_positions) and saves
its state there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ladle.startup.engine_config import EngineConfig
from ladle.engine.admission import check_admissible
from ladle.engine.checkpoint_positions import checkpoint_at, with_checkpoint
from ladle.engine.core_output import EngineCoreOutput
from ladle.engine.fair_shares import fair_shares
from ladle.engine.prefix_wait import prefix_in_flight
from ladle.engine.stats import EngineStats
from ladle.engine.structured_step import compiling
from ladle.startup.partial_prefill import default_limits
from ladle.engine.request_queue import RequestQueue
from ladle.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from ladle.engine.speculator import Speculator
from ladle.engine.step_update import update_from_output
from ladle.kv_cache.manager import KVCacheManager
from ladle.kv_cache.prefix_hits import PrefixHit
from ladle.request import Request, RequestStatus
from ladle.runner.model_runner import SampledToken
from ladle.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("ladle.scheduler")
MAX_PASS_OVER = 32  # admissions that may jump ahead of a waiting request the KV pool cannot take yet


@dataclass(frozen=True)
class _Candidate:
    """A waiting request that may start this step, with its prefix-cache hit."""

    request: Request
    hit: PrefixHit

    @property
    def num_cached(self) -> int:
        return self.hit.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, stats: EngineStats | None = None,
                 grammars: StructuredOutputManager | None = None) -> None:
        """grammars: the constrained requests' matchers (None: the engine takes no constrained request)."""
        self.config = config
        self.kv = kv
        self.stats = stats if stats is not None else EngineStats()
        self.grammars = grammars
        self.limits = config.partial_prefills or default_limits(config.max_num_seqs, config.max_num_batched_tokens)
        self.waiting = RequestQueue(config.scheduling_policy)
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running, by id
        self.max_pass_over = MAX_PASS_OVER
        spec = config.speculative
        self.speculator = None if spec is None else Speculator(spec, config.max_model_len, self.stats, grammars)

    def check(self, request: Request) -> None:
        check_admissible(request, self.config, self.kv, self.waiting.policy)

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.add(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        running = self.running if self.waiting.policy == "fcfs" else sorted(self.running, key=self.waiting.key)
        decodes = [r for r in running if not r.is_prefilling]
        drafts = self.speculator.drafts(decodes, budget) if self.speculator is not None and decodes else {}
        for req in decodes:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            d = self._room_for(req, drafts.get(req.request_id, ()), budget)
            if self._reserve(req, 1 + len(d), scheduled, out):
                out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, 1 + len(d), False,
                                                      draft_token_ids=d))
                scheduled.add(req.request_id)
                budget -= 1 + len(d)
        prefills = [r for r in running if r.is_prefilling and r.status is RequestStatus.RUNNING]
        num_long = sum(self.limits.is_long(r.num_tokens - r.num_computed_tokens) for r in prefills)
        # A step that preempted is short of blocks: admitting now would only thrash.
        starts = [] if out.preempted_ids or budget == 0 else self._candidates(len(prefills), num_long)
        shares = fair_shares([self._demand(r, r.num_computed_tokens) for r in prefills]
                             + [self._demand(c.request, c.num_cached) for c in starts], budget)
        chunks: list[ScheduledRequest] = []
        for req, n in zip(prefills, shares):
            if n and req.status is RequestStatus.RUNNING and self._reserve(req, n, scheduled, out):
                chunks.append(ScheduledRequest(req, req.num_computed_tokens, n, True))
                scheduled.add(req.request_id)
        blocked: list[Request] = []  # waiting requests the pool could not take, passed over by later ones
        for c, n in zip(starts, shares[len(prefills):]):
            if out.preempted_ids or any(r.num_passed_over >= self.max_pass_over for r in blocked):
                break
            if n == 0:
                continue
            n = self._admit(c, n, out)
            if not n:
                blocked.append(c.request)
                continue
            for r in blocked:
                r.num_passed_over += 1
            chunks.append(ScheduledRequest(c.request, c.request.num_computed_tokens, n, True))
            scheduled.add(c.request.request_id)
        out.scheduled += self._top_up(chunks, budget - sum(s.num_new_tokens for s in chunks))
        if self.speculator is not None and self.speculator.proposer is None:
            self._ask_for_drafts(out)
        for i, s in enumerate(out.scheduled):
            if s.is_prefill:
                self._log_chunk(s)
                if self.kv.checkpointing:
                    out.scheduled[i] = with_checkpoint(self.kv, self.config.state_checkpoint_interval, s)
        return out

    def _room_for(self, req: Request, drafts: tuple[int, ...], budget: int) -> tuple[int, ...]:
        """The drafts a decode row carries: none where the budget or the pool (without preempting anyone) lacks
        room for them, as drafts are never worth a preemption."""
        if not drafts or len(drafts) + 1 > budget:
            return ()
        start = req.num_computed_tokens
        return drafts if self.kv.allocate(req.request_id, start + 1 + len(drafts), num_computed=start) else ()

    def _ask_for_drafts(self, out: SchedulerOutput) -> None:
        """mtp: the drafts each sampled row's MTP layer makes (Speculator.proposals; None: it rests this step),
        and blocks for the n - 1 positions past its next token that n write, where the pool has them unpreempted."""
        assert self.speculator is not None
        wanted = self.speculator.proposals([s.request for s in out.scheduled if s.samples])
        if wanted is None:
            out.mtp_rests = True
            return
        for i, s in enumerate(out.scheduled):
            n = wanted.get(s.request.request_id, 0)
            if n:
                out.scheduled[i] = replace(s, num_proposals=n)
                if n > 1:
                    self.kv.allocate(s.request.request_id, s.start_pos + s.num_new_tokens + n - 1,
                                     num_computed=s.start_pos)

    def _checkpoint_at(self, req: Request, start: int) -> int | None:
        return checkpoint_at(self.kv, self.config.state_checkpoint_interval, req, start)

    def _demand(self, req: Request, start: int) -> int:
        """The most tokens req's next chunk from start may take: to its end, within the chunk cap, and no
        further than its next checkpoint position."""
        end = self._checkpoint_at(req, start) or req.num_tokens
        return min(end - start, self.config.max_prefill_length)

    def _candidates(self, num_prefills: int, num_long: int) -> list[_Candidate]:
        """Waiting requests that may start beside the running prefills, in queue order: within the partial-
        prefill caps and max_num_seqs; a long one over the long cap, or one whose prefix a running request is
        about to write (ladle.engine.prefix_wait), is passed over and keeps its place."""
        room = min(self.limits.max_num_partial_prefills - num_prefills, self.config.max_num_seqs - len(self.running))
        found: list[_Candidate] = []
        for req in self.waiting:
            if len(found) >= room:
                break
            if compiling(self.grammars, req):
                continue  # passed over, keeping its place, until its grammar is compiled
            hit = self.kv.get_computed_blocks(req)
            if self._prefix_in_flight(req, hit.num_tokens, [c.request for c in found]):
                continue
            if self.limits.is_long(req.num_tokens - hit.num_tokens):
                if num_long >= self.limits.max_long_partial_prefills:
                    continue
                num_long += 1
            found.append(_Candidate(req, hit))
        return found

    def _admit(self, c: _Candidate, n: int, out: SchedulerOutput) -> int:
        """Start c with a first chunk of at most n tokens if the pool can take its whole (re)prefill, so an
        admitted prompt never stalls between chunks; returns the chunk's tokens (0: not admitted). Cached
        blocks cost only what taking them out of the free queue costs."""
        req = c.request
        # The hit was looked up before this step's other requests took blocks, which may have evicted some of
        # it: look again, so a block handed out since is never taken as cached (the hit can only shrink).
        hit = self.kv.get_computed_blocks(req) if c.num_cached else c.hit
        num_cached = hit.num_tokens
        # A hit shallower than the first lookup's leaves a longer first chunk, which must still stop at the
        # next checkpoint position.
        n = min(n, self._demand(req, num_cached))
        chunk = min(self.config.max_prefill_length, self.config.max_num_batched_tokens)
        if not self.kv.admit(req.request_id, req.num_tokens, num_cached + n, chunk, hit):
            return 0
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_cached_tokens = num_cached
        req.num_passed_over = 0
        if self.kv.enable_caching:
            out.prefix_cache_queries += req.num_tokens
            out.prefix_cache_hits += num_cached
            out.prefix_cache_hit_requests += num_cached > 0
            logger.debug("admitted request=%s prefix_cache_hit=%d of %d tokens", req.request_id, num_cached,
                         req.num_tokens)
        self.running.append(req)
        return n

    def _top_up(self, chunks: list[ScheduledRequest], left: int) -> list[ScheduledRequest]:
        """Budget a failed admission (or a preemption) left unused goes to the scheduled prefills, in order,
        where the pool has the blocks without preempting anyone."""
        topped = []
        for s in chunks:
            extra = min(left, self._demand(s.request, s.start_pos) - s.num_new_tokens)
            if extra > 0 and self.kv.allocate(s.request.request_id, s.start_pos + s.num_new_tokens + extra,
                                              num_computed=s.start_pos):
                s = replace(s, num_new_tokens=s.num_new_tokens + extra)
                left -= extra
            topped.append(s)
        return topped

    def update_from_output(self, sched: SchedulerOutput,
                           sampled: dict[str, SampledToken]) -> list[EngineCoreOutput]:
        """After sched ran: each request advances by its chunk and registers the blocks it filled, takes its
        sampled tokens, and finishes on a stop token or at its length (freed here; its output says so)."""
        return update_from_output(self, sched, sampled)

    def fail(self, req: Request, message: str, code: str | None = None) -> EngineCoreOutput:
        """End req with an error (code: EngineCoreOutput.error_code), so the engine can keep serving the others."""
        self.finish(req, RequestStatus.FINISHED_ERROR)
        self.stats.requests_failed += 1
        return EngineCoreOutput(req.request_id, finish_reason="error", error=message, error_code=code,
                                prefill_chunks=req.prefill_chunks)

    def _prefix_in_flight(self, req: Request, num_cached: int, starting: list[Request]) -> bool:
        end = self._checkpoint_at(req, num_cached) or num_cached + self.kv.block_size
        return self.kv.enable_caching and prefix_in_flight(req, num_cached, end, self.running + starting)

    def _reserve(self, req: Request, n: int, scheduled_ids: set[str], out: SchedulerOutput) -> bool:
        """Make room for n more tokens of req, preempting the newest unscheduled requests if needed."""
        while not self.kv.allocate(req.request_id, req.num_computed_tokens + n, num_computed=req.num_computed_tokens):
            victim = self._victim([r for r in self.running if r.request_id not in scheduled_ids])
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _victim(self, unscheduled: list[Request]) -> Request:
        """fcfs: the newest request; priority: the lowest priority (largest value), newest among equals."""
        if self.waiting.policy == "fcfs":
            return unscheduled[-1]
        return max(unscheduled, key=self.waiting.key)

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
        self.waiting.prepend(req)
        logger.debug("preempted %s (%d tokens to recompute)", req.request_id, req.num_tokens)

    def _log_chunk(self, s: ScheduledRequest) -> None:
        remaining = s.request.num_tokens - s.start_pos
        logger.debug("prefill chunk request=%s chunk_size=%d remain=%d cached=%d budget=%d chunked=%s",
                     s.request.request_id, s.num_new_tokens, remaining, s.start_pos,
                     min(self.config.max_prefill_length, self.config.max_num_batched_tokens),
                     s.num_new_tokens < remaining)

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
        self.kv.free(req.request_id)

    def find(self, request_id: str) -> Request | None:
        """O(1): a large offline batch adds each of its requests after a lookup of its id."""
        return self.requests.get(request_id)
