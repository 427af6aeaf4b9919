"""Runs one scheduled step so that whatever goes wrong for one request ends that request only.

- Out of memory: the step runs again with half its tokens (not below one block), then its first request
  alone. The KV of a retried step lands in the same slots, so nothing is lost and no output changes.
- Any other exception: the step is split in halves and each half runs, recursively, so only a request that
  fails alone is ended; the others get the outputs they would have got without it. A tiered expert whose file
  changed since load (ExpertFileError) is isolated so too: the requests routed to it end with its message, which
  names the file and the expert, and as its cause is known such failures never count toward ending the engine.
- A seeded request's draw is a function of its seed and the position drawn (ladle.runner.sampling_batch), so
  a retried step draws what the first attempt would have.
- Models with a per-request state (Gated DeltaNet) advance it in place, so a step that failed after its
  forward began cannot simply run again. Its requests restart from their first token (as a preemption does:
  nothing generated is lost) and become suspects; a later step holding a suspect snapshots its requests'
  states first and restores them before each retry, so the retries and the isolation above work as usual.
  Ordinary steps pay nothing for this.

A row the sampler cannot sample (NaN logits, say) is not an exception: it comes back as FAILED and the core
ends that request (see EngineCore._update).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ladle.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from ladle.engine.stats import EngineStats
from ladle.executor.executor import Executor, FatalStepError, StateSnapshot
from ladle.experts.expert_files import ExpertFileError
from ladle.runner.payload import ChunkSpec, SampledToken

logger = logging.getLogger("ladle")

_OOM = (torch.OutOfMemoryError, MemoryError)
EXPERT_FILE_CODE = "expert_file_changed"  # EngineCoreOutput.error_code of a request failed by an ExpertFileError


def chunk_specs(sched: SchedulerOutput) -> list[ChunkSpec]:
    """The step as the runner sees it: request ids and positions, no live objects."""
    rest = sched.mtp_rests
    return [ChunkSpec(s.request.request_id, s.start_pos, s.num_new_tokens, s.samples, s.checkpoint, s.bitmask,
                      s.draft_token_ids, -1 if rest else s.num_proposals) for s in sched.scheduled]


@dataclass(frozen=True)
class RequestFailure:
    request_id: str
    message: str  # for the client: no exception text (the log has it, under the request id) but an ExpertFileError's
    code: str | None = None  # EngineCoreOutput.error_code: None for a failure of the engine


@dataclass
class StepResult:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    sched: SchedulerOutput = field(default_factory=SchedulerOutput)  # what ran: its requests advance
    failures: list[RequestFailure] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)  # state lost in a failed step: recompute from the start


class StepExecutor:
    def __init__(self, executor: Executor, min_tokens: int, device: torch.device, stats: EngineStats) -> None:
        self.executor = executor
        self.min_tokens = min_tokens  # an OOM retry never goes below this many tokens (one block)
        self.device = device
        self.stats = stats
        # A test hook run before each forward call (e.g. to inject an error for one request).
        self.before_execute: Callable[[SchedulerOutput], None] | None = None
        self.suspects: set[str] = set()  # requests restarted after a failed step of a model with state

    def forget(self, request_id: str) -> None:
        self.suspects.discard(request_id)

    def run(self, sched: SchedulerOutput) -> StepResult:
        rids = [s.request.request_id for s in sched.scheduled]
        snapshot = None if self.suspects.isdisjoint(rids) else self.executor.snapshot_states(rids)
        while True:
            self.executor.state_touched = False
            try:
                if self.before_execute is not None:
                    self.before_execute(sched)
                return StepResult(self.executor.execute(chunk_specs(sched)), sched)
            except FatalStepError:
                raise
            except _OOM as e:
                if self._state_lost(snapshot):
                    return self._restart(sched, e)
                retry = self._after_oom(sched, e)
                if retry is None:
                    return StepResult(failures=[RequestFailure(
                        s.request.request_id,
                        f"out of memory even for a step of {sched.num_tokens} tokens ({type(e).__name__}); "
                        f"request {s.request.request_id} was ended so the engine can keep serving")
                        for s in sched.scheduled])
                sched = retry
            except Exception as e:  # noqa: BLE001 -- whatever it is, it must not take the batch down
                if self._state_lost(snapshot):
                    return self._restart(sched, e)
                return self._isolate(sched, e)

    def _state_lost(self, snapshot: StateSnapshot | None) -> bool:
        """Whether the failed attempt may have advanced states that cannot be put back."""
        if not self.executor.state_touched:
            return False
        if snapshot is not None:
            self.executor.restore_states(snapshot)
            return False
        return True

    def _restart(self, sched: SchedulerOutput, error: BaseException) -> StepResult:
        rids = [s.request.request_id for s in sched.scheduled]
        logger.warning("a step of %d requests failed after its state layers ran (%s); they restart from their "
                       "first token", len(rids), type(error).__name__)
        self.stats.state_restarts += 1
        self.suspects.update(rids)
        return StepResult(sched=replace(sched, scheduled=[]), restarted=rids)

    def _after_oom(self, sched: SchedulerOutput, error: BaseException) -> SchedulerOutput | None:
        """The step to try next after an out-of-memory error, or None when even the smallest one failed."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.stats.oom_retries += 1
        if sched.num_tokens > self.min_tokens:
            budget = max(self.min_tokens, sched.num_tokens // 2)
            logger.warning("out of memory in a step of %d tokens (%s); retrying it with %d tokens",
                           sched.num_tokens, type(error).__name__, budget)
            return sched.shrink(budget)
        if len(sched.scheduled) > 1:
            # At the smallest step, run one request alone, so only a request that fails alone is ended.
            logger.warning("out of memory in a step of %d tokens; retrying its first request alone",
                           sched.num_tokens)
            return replace(sched, scheduled=sched.scheduled[:1])
        logger.error("out of memory even for a step of %d tokens: ending request %s", sched.num_tokens,
                     sched.scheduled[0].request.request_id)
        return None

    def _isolate(self, sched: SchedulerOutput, error: Exception) -> StepResult:
        """Run each half of a step that raised; a request that raises alone is the one that fails."""
        self.stats.isolation_retries += 1
        if len(sched.scheduled) == 1:
            return StepResult(failures=[self._failure(sched.scheduled[0], error)])
        half = len(sched.scheduled) // 2
        result = StepResult(sched=replace(sched, scheduled=[]))
        for part in (sched.scheduled[:half], sched.scheduled[half:]):
            sub = self.run(replace(sched, scheduled=part))
            result.sampled.update(sub.sampled)
            result.sched.scheduled.extend(sub.sched.scheduled)
            result.failures.extend(sub.failures)
        return result

    @staticmethod
    def _failure(s: ScheduledRequest, error: Exception) -> RequestFailure:
        rid = s.request.request_id
        if isinstance(error, ExpertFileError):
            # Its message is written for the client, and the file's failure was logged in full once already.
            logger.warning("request %s needs a tiered expert that cannot be read; ending it", rid)
            return RequestFailure(rid, f"request {rid} was ended: {error}", EXPERT_FILE_CODE)
        logger.error("request %s fails alone in a step (%d tokens from position %d); ending it", rid,
                     s.num_new_tokens, s.start_pos, exc_info=error)
        return RequestFailure(rid, f"the engine failed running request {rid} ({type(error).__name__}); it was "
                                   "ended so the engine can keep serving (the server log has the details)")
