"""The scheduler's bookkeeping after a step ran (Scheduler.update_from_output): each request advances by what
its chunk computed and registers the blocks it filled, takes its sampled tokens (more than one where drafts
were accepted), and finishes on a stop token, a complete grammar or its length."""
from __future__ import annotations

from typing import Protocol

from ladle.engine.core_output import EngineCoreOutput
from ladle.engine.scheduler_output import SchedulerOutput
from ladle.engine.stop_check import check_stop
from ladle.engine.speculator import Speculator
from ladle.engine.stats import EngineStats
from ladle.engine.structured_step import advance, grammar_error
from ladle.kv_cache.manager import KVCacheManager
from ladle.outputs import Logprob
from ladle.request import Request, RequestStatus
from ladle.runner.model_runner import PROMPT_ONLY, SampledToken
from ladle.runner.sampler import FAILED
from ladle.startup.engine_config import EngineConfig
from ladle.structured_output.manager import StructuredOutputManager


class Scheduler(Protocol):
    """What of ladle.engine.scheduler.Scheduler the bookkeeping reads and calls."""

    config: EngineConfig
    stats: EngineStats
    kv: KVCacheManager
    grammars: StructuredOutputManager | None
    speculator: Speculator | None

    def finish(self, req: Request, status: RequestStatus) -> None: ...

    def fail(self, req: Request, message: str, code: str | None = None) -> EngineCoreOutput: ...

_NOT_FINITE = ("request {} could not be sampled: its next-token distribution is not finite (NaN or inf){}; it was "
               "ended so the engine can keep serving")


def update_from_output(scheduler: Scheduler, sched: SchedulerOutput,
                       sampled: dict[str, SampledToken]) -> list[EngineCoreOutput]:
    stats = scheduler.stats
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
            assert scheduler.speculator is not None
            scheduler.speculator.verified(req.request_id, len(s.draft_token_ids), accepted)
        req.num_computed_tokens += computed
        # Only now is this step's KV written, so only now may its full blocks be served to others.
        scheduler.kv.cache_full_blocks(req, req.num_computed_tokens)
        if tok is None:
            continue
        if tok.prompt_logprobs is not None:
            _keep_prompt_logprobs(req, *tok.prompt_logprobs)
        if tok.token_id == PROMPT_ONLY:
            continue
        req.spec_token_ids = tok.drafts
        if tok.token_id == FAILED and not tok.accepted:
            broken = grammar_error(scheduler.grammars, req)  # a grammar that broke allows no token
            outs.append(scheduler.fail(req, broken or _NOT_FINITE.format(req.request_id, " or masks every token"),
                                       "invalid_grammar" if broken else None))
            continue
        outs.append(_take(scheduler, req, [*tok.accepted, (tok.token_id, tok.logprobs)]))
    if scheduler.kv.checkpointing:
        ck = scheduler.kv.checkpoints
        stats.state_checkpoints_stored, stats.state_checkpoints_evicted = ck.num_stored, ck.num_evicted
        stats.state_checkpoint_bytes = ck.bytes_held
    return outs


def _take(scheduler: Scheduler, req: Request, tokens: list[tuple[int, dict[int, Logprob] | None]]) -> EngineCoreOutput:
    """req's sampled tokens in order, up to the one that ends it (those after a stop are dropped). A FAILED
    token after accepted drafts ends the request with an error once those are out."""
    first = req.num_output_tokens == 0
    out = EngineCoreOutput(req.request_id, [], [], num_cached_tokens=req.num_cached_tokens if first else None)
    if first and req.prompt_logprobs is not None:
        out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None  # handed out once, with the first token
    for token_id, logprobs in tokens:
        if token_id == FAILED:
            return _fail_after(out, scheduler.fail(req, _NOT_FINITE.format(req.request_id, "")))
        scheduler.stats.generation_tokens += 1
        req.append_output(token_id, logprobs)
        refused, complete = advance(scheduler.grammars, req, token_id)
        if refused is not None:
            return _fail_after(out, scheduler.fail(req, refused, "invalid_grammar"))
        out.new_token_ids.append(token_id)
        out.new_logprobs.append(logprobs)
        status = check_stop(req, scheduler.config.max_model_len, complete)
        if status is not None:
            scheduler.finish(req, status)
            out.finish_reason, out.stop_reason = status.value, req.stop_reason
            out.stop_token = status is RequestStatus.FINISHED_STOPPED and token_id in req.stop_token_ids
            out.prefill_chunks = req.prefill_chunks
            break
    return out


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
