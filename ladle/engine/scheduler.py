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
a prefill chunk ends at the request's next checkpoint position (next_checkpoint) and saves its state there.

After a step ran (update_from_output), each request advances by what its chunk computed and registers the
blocks it filled, takes its sampled tokens (more than one where drafts were accepted), and finishes on a stop
token, a complete grammar or its length. With async scheduling, schedule_ahead schedules the next step while
the one before it is still running, where that cannot differ from what schedule() would return.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ladle.engine.core_output import EngineCoreOutput
from ladle.engine.request_queue import RequestQueue, scheduling_policy
from ladle.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from ladle.engine.speculation.speculator import Speculator
from ladle.engine.stats import EngineStats
from ladle.engine.structured_step import advance, compiling, grammar_error
from ladle.kv_cache.manager import KVCacheManager
from ladle.kv_cache.prefix_hits import PrefixHit
from ladle.outputs import Logprob
from ladle.request import Request, RequestRejected, RequestStatus
from ladle.runner.payload import FAILED, PROMPT_ONLY, SampledToken
from ladle.startup.engine_config import EngineConfig
from ladle.startup.partial_prefill import default_limits
from ladle.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("ladle.scheduler")
MAX_PASS_OVER = 32  # admissions that may jump ahead of a waiting request the KV pool cannot take yet
_NOT_FINITE = ("request {} could not be sampled: its next-token distribution is not finite (NaN or inf){}; it was "
               "ended so the engine can keep serving")


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
        self.policy = scheduling_policy(config.scheduling_policy)
        self.waiting = RequestQueue(self.policy)
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running, by id
        self.max_pass_over = MAX_PASS_OVER
        spec = config.speculative
        self.speculator = None if spec is None else Speculator(spec, config.max_model_len, self.stats, grammars)

    def check(self, request: Request) -> None:
        """Reject now what could never run on this engine, so it never waits at the head of the queue for what
        cannot come."""
        self.policy.check(request)
        cfg, kv = self.config, self.kv
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

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.add(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv.poll_disk()
        self.kv.expire_sessions()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        running = self.policy.order(self.running)
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
                    out.scheduled[i] = self._with_checkpoint(s)
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
            if req.sampling_params.structured_outputs is not None:
                return None  # its bitmask needs the token sched samples
            if req.num_output_tokens + 2 > req.max_tokens or req.num_tokens + 2 > self.config.max_model_len:
                return None
        need = sum(self.kv.num_blocks_to_allocate(s.request.request_id, s.start_pos + 2) for s in sched.scheduled)
        if need > self.kv.num_free_blocks:
            return None
        for s in sched.scheduled:
            allocated = self.kv.allocate(s.request.request_id, s.start_pos + 2)
            assert allocated, "free blocks were counted above"
        return SchedulerOutput([ScheduledRequest(s.request, s.start_pos + 1, 1, False) for s in sched.scheduled])

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
        """req's next checkpoint position after start, where the engine keeps checkpoints (None elsewhere)."""
        if not self.kv.checkpointing:
            return None
        return next_checkpoint(req, start, self.config.state_checkpoint_interval, self.kv.block_size)

    def _with_checkpoint(self, s: ScheduledRequest) -> ScheduledRequest:
        """The chunk s saving its request's state where it ends, if that is a checkpoint position (and a
        checkpoint slot is free)."""
        end = s.start_pos + s.num_new_tokens
        if self._checkpoint_at(s.request, s.start_pos) != end:
            return s
        copy = self.kv.plan_checkpoint(s.request.request_id, end)
        return s if copy is None else replace(s, checkpoint=copy)

    def _demand(self, req: Request, start: int) -> int:
        """The most tokens req's next chunk from start may take: to its end, within the chunk cap, and no
        further than its next checkpoint position."""
        end = self._checkpoint_at(req, start) or req.num_tokens
        return min(end - start, self.config.max_prefill_length)

    def _candidates(self, num_prefills: int, num_long: int) -> list[_Candidate]:
        """Waiting requests that may start beside the running prefills, in queue order: within the partial-
        prefill caps and max_num_seqs; a long one over the long cap, or one whose prefix a running request is
        about to write (_prefix_in_flight), is passed over and keeps its place."""
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
            if self.kv.fetch_from_disk(req, hit):
                continue  # passed over, keeping its place, while its prefix's blocks are read from disk
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
        stats = self.stats
        stats.prefix_cache_queries += sched.prefix_cache_queries
        stats.prefix_cache_hits += sched.prefix_cache_hits
        stats.prefix_cache_hit_requests += sched.prefix_cache_hit_requests
        outs = []
        for s in sched.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                # Finished or aborted while this step, launched ahead, was running: its token is void.
                stats.tokens_dropped += 1
                continue
            if s.is_prefill:
                req.prefill_chunks.append(s.num_new_tokens)
                stats.prompt_tokens += s.num_new_tokens
            tok = sampled.get(req.request_id)
            computed = s.num_new_tokens
            if s.draft_token_ids:  # the KV of rejected drafts stays where it is, to be written over
                accepted = len(tok.accepted) if tok is not None else 0
                computed -= len(s.draft_token_ids) - accepted
                assert self.speculator is not None
                self.speculator.verified(req.request_id, len(s.draft_token_ids), accepted)
            req.num_computed_tokens += computed
            # Only now is this step's KV written, so only now may its full blocks be served to others.
            self.kv.cache_full_blocks(req, req.num_computed_tokens)
            if tok is None:
                continue
            if tok.prompt_logprobs is not None:
                _keep_prompt_logprobs(req, *tok.prompt_logprobs)
            if tok.token_id == PROMPT_ONLY:
                continue
            req.spec_token_ids = tok.drafts
            if tok.token_id == FAILED and not tok.accepted:
                broken = grammar_error(self.grammars, req)  # a grammar that broke allows no token
                outs.append(self.fail(req, broken or _NOT_FINITE.format(req.request_id, " or masks every token"),
                                      "invalid_grammar" if broken else None))
                continue
            outs.append(self._take(req, [*tok.accepted, (tok.token_id, tok.logprobs)]))
        if self.kv.checkpointing:
            ck = self.kv.checkpoints
            stats.state_checkpoints_stored, stats.state_checkpoints_evicted = ck.num_stored, ck.num_evicted
            stats.state_checkpoint_bytes = ck.bytes_held
        return outs

    def _take(self, req: Request, tokens: list[tuple[int, dict[int, Logprob] | None]]) -> EngineCoreOutput:
        """req's sampled tokens in order, up to the one that ends it (those after a stop are dropped). A FAILED
        token after accepted drafts ends the request with an error once those are out."""
        first = req.num_output_tokens == 0
        out = EngineCoreOutput(req.request_id, [], [], num_cached_tokens=req.num_cached_tokens if first else None)
        if first and req.prompt_logprobs is not None:  # handed out once, with the first token
            out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        for token_id, logprobs in tokens:
            if token_id == FAILED:
                return _fail_after(out, self.fail(req, _NOT_FINITE.format(req.request_id, "")))
            self.stats.generation_tokens += 1
            req.append_output(token_id, logprobs)
            refused, complete = advance(self.grammars, req, token_id)
            if refused is not None:
                return _fail_after(out, self.fail(req, refused, "invalid_grammar"))
            out.new_token_ids.append(token_id)
            out.new_logprobs.append(logprobs)
            status = _stop_status(req, self.config.max_model_len, complete)
            if status is not None:
                self.finish(req, status)
                out.finish_reason, out.stop_reason = status.value, req.stop_reason
                out.stop_token = status is RequestStatus.FINISHED_STOPPED and token_id in req.stop_token_ids
                out.prefill_chunks = req.prefill_chunks
                break
        return out

    def fail(self, req: Request, message: str, code: str | None = None) -> EngineCoreOutput:
        """End req with an error (code: EngineCoreOutput.error_code), so the engine can keep serving the others."""
        self.finish(req, RequestStatus.FINISHED_ERROR)
        self.stats.requests_failed += 1
        return EngineCoreOutput(req.request_id, finish_reason="error", error=message, error_code=code,
                                prefill_chunks=req.prefill_chunks)

    def _prefix_in_flight(self, req: Request, num_cached: int, starting: list[Request]) -> bool:
        """True when one of the running or starting requests has yet to write req's prefix up to the next
        position req could resume from (its next block, or its next checkpoint position on a model with state
        checkpoints), having the same tokens before it.

        Waiting for it (one step, or until that request's chunked prefill passes the position) beats computing
        the same KV twice. This is how n > 1 siblings, admitted together, share their prompt: the first
        prefills it, the others follow a step later and hit its blocks. Requests behind a deferred one may be
        admitted meanwhile; the deferred one keeps its place at the head of the queue.
        """
        if not self.kv.enable_caching:
            return False
        end = self._checkpoint_at(req, num_cached) or num_cached + self.kv.block_size
        if req.skip_reading_prefix_cache:
            return False  # it reads no prefix (prompt logprobs): nothing to wait for
        if end > req.num_tokens - 1:
            return False  # no further block of req would be reused: a hit stops before the last token
        tokens = req.all_token_ids
        for other in self.running + starting:
            ids = other.all_token_ids
            if (other.num_computed_tokens < end <= len(ids) and ids[num_cached:end] == tokens[num_cached:end]
                    and ids[:num_cached] == tokens[:num_cached]):
                return True
        return False

    def _reserve(self, req: Request, n: int, scheduled_ids: set[str], out: SchedulerOutput) -> bool:
        """Make room for n more tokens of req, preempting unscheduled requests (the policy's victims) if needed."""
        while not self.kv.allocate(req.request_id, req.num_computed_tokens + n, num_computed=req.num_computed_tokens):
            victim = self._victim([r for r in self.running if r.request_id not in scheduled_ids])
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _victim(self, unscheduled: list[Request]) -> Request:
        return self.policy.victim(unscheduled)

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
        self.kv.free(req.request_id, req.session_id)

    def find(self, request_id: str) -> Request | None:
        """O(1): a large offline batch adds each of its requests after a lookup of its id."""
        return self.requests.get(request_id)


def next_checkpoint(req: Request, start: int, interval: int, block_size: int) -> int | None:
    """The first checkpoint position after start that req's known tokens reach, or None. A request's state is
    checkpointed while it prefills, so later requests can resume there: every interval tokens, where its prompt
    ends (and one block earlier when the prompt is block-aligned: a request with the very same prompt stops its
    hit before the last token), and where the frontend marked a message's end (Request.checkpoint_marks). Each
    rounded down to a block boundary: a hit resumes only there."""
    candidates = [(start // interval + 1) * interval]
    for pos in (req.num_prompt_tokens, req.num_prompt_tokens - 1, *req.checkpoint_marks):
        at = pos // block_size * block_size
        if at > start:
            candidates.append(at)
    best = min(candidates)
    return best if best <= req.num_tokens else None


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


def _stop_status(req: Request, max_model_len: int, grammar_complete: bool = False) -> RequestStatus | None:
    """How the last token ends req, if it does: a stop token (past min_tokens), a structured-output grammar
    that allows nothing more (grammar_complete), max_tokens or the context."""
    last = req.output_token_ids[-1]
    if req.num_output_tokens >= req.sampling_params.min_tokens and last in req.stop_token_ids:
        if last in req.sampling_params.stop_token_ids:
            req.stop_reason = last
        return RequestStatus.FINISHED_STOPPED
    if grammar_complete:
        return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def _keep_prompt_logprobs(req: Request, first: int, entries: list[dict[int, Logprob]]) -> None:
    """Put a chunk's prompt logprobs at their positions (a chunk run again after a preemption overwrites
    its own); dropped once handed out."""
    if req.prompt_logprobs is not None:
        req.prompt_logprobs[first : first + len(entries)] = entries


def _fail_after(out: EngineCoreOutput, failed: EngineCoreOutput) -> EngineCoreOutput:
    """The error output, carrying the tokens the request got before it in the same step."""
    failed.new_token_ids, failed.new_logprobs = out.new_token_ids, out.new_logprobs
    failed.num_cached_tokens = out.num_cached_tokens
    failed.prompt_logprobs = out.prompt_logprobs
    return failed
