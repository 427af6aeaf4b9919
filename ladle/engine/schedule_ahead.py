"""Async scheduling's step ahead: the next step, scheduled while the one before it is still running."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ladle.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from ladle.request import RequestStatus

if TYPE_CHECKING:
    from ladle.engine.scheduler import Scheduler


def schedule_ahead(scheduler: Scheduler, sched: SchedulerOutput) -> SchedulerOutput | None:
    """The step after `sched`, scheduled before sched's tokens are known (async scheduling): the same
    decodes one token further. None unless that is exactly what schedule() would return once they are
    known: every running request is a decode of sched, none finishes by length at sched, no waiting
    request could be admitted, and the pool has every block the next tokens need (allocated here) without
    preempting anyone. A request that stops on a token at sched has its step-ahead result dropped."""
    if sched.preempted_ids or len(sched.scheduled) != len(scheduler.running) or scheduler.kv.has_sliding_window:
        return None  # (a window would give blocks back under the step in flight: run synchronously)
    if scheduler.waiting and len(scheduler.running) < scheduler.config.max_num_seqs:
        return None
    for s in sched.scheduled:
        req = s.request
        if s.is_prefill or s.num_new_tokens != 1 or req.status is not RequestStatus.RUNNING:
            return None
        if req.sampling_params.structured_outputs is not None:
            return None  # its bitmask needs the token sched samples
        if req.num_output_tokens + 2 > req.max_tokens or req.num_tokens + 2 > scheduler.config.max_model_len:
            return None
    need = sum(scheduler.kv.num_blocks_to_allocate(s.request.request_id, s.start_pos + 2) for s in sched.scheduled)
    if need > scheduler.kv.num_free_blocks:
        return None
    for s in sched.scheduled:
        allocated = scheduler.kv.allocate(s.request.request_id, s.start_pos + 2)
        assert allocated, "free blocks were counted above"
    return SchedulerOutput([ScheduledRequest(s.request, s.start_pos + 1, 1, False) for s in sched.scheduled])
