"""The engine side of the runner's copy of the requests: what the runner has been told of each one, so each
step's StateUpdate carries only what changed: new or resumed requests whole, the others' new blocks. Their new
tokens it never sends: the runner appended them itself when it sampled them."""
from __future__ import annotations

from dataclasses import dataclass

from ladle.engine.scheduler_output import SchedulerOutput
from ladle.kv_cache.manager import KVCacheManager
from ladle.runner.payload import NewRequest, RequestDiff, StateUpdate


@dataclass
class _Sent:
    blocks: list[int]  # leading blocks of each group's table it has
    tables: tuple[list[int], ...]  # the KV manager's table objects they came from


class RunnerSync:
    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._removed: list[str] = []

    def forget(self, request_id: str) -> None:
        """The request left the running set (finished, aborted or restarted): the runner is to forget it."""
        if self._sent.pop(request_id, None) is not None:
            self._removed.append(request_id)

    def flush(self, kv: KVCacheManager) -> StateUpdate:
        """Who left, and the disk tier's writes: sent when the engine goes idle, so the runner holds no ended
        request meanwhile and the last step's blocks reach the disk without waiting for another step."""
        update, self._removed = StateUpdate(removed=self._removed), []
        if kv.disk is not None:
            update.kv_fills, update.checkpoint_fills, update.kv_stores, update.kv_unlinks = kv.disk.take()
        if kv.host_checkpoints is not None:
            update.checkpoint_saves, update.checkpoint_loads = kv.host_checkpoints.take_transfers()
        return update

    def update(self, sched: SchedulerOutput, kv: KVCacheManager) -> StateUpdate:
        """What the runner needs before it runs `sched`: the requests it does not hold (or holds with an old
        table, after a preemption) in full, the others' new blocks, and who left meanwhile (the requests this
        very schedule preempted among them)."""
        for rid in sched.preempted_ids:
            self.forget(rid)
        update = StateUpdate(removed=self._removed)
        self._removed = []
        groups = kv.groups
        for s in sched.scheduled:
            req, rid = s.request, s.request.request_id
            seen = self._sent.get(rid)
            if seen is None:
                tables = tuple(g.tables[rid] for g in groups)
                update.new_requests.append(NewRequest(rid, list(req.all_token_ids), req.num_prompt_tokens,
                                                      req.sampling_params, req.stop_token_ids,
                                                      tuple(list(t) for t in tables), kv.state_slots.get(rid, -1),
                                                      kv.restores.pop(rid, None)))
                self._sent[rid] = _Sent([len(t) for t in tables], tables)
                continue
            # A decode step adds a block every block_size tokens: most steps send nothing for a request.
            grew = False
            for t, n in zip(seen.tables, seen.blocks):
                grew = grew or len(t) > n
            if grew:
                update.diffs.append(RequestDiff(rid, tuple(t[n:] for t, n in zip(seen.tables, seen.blocks))))
                seen.blocks = [len(t) for t in seen.tables]
        if kv.host is not None:
            update.kv_saves, update.kv_loads = kv.host.take_transfers()
        if kv.disk is not None:
            update.kv_fills, update.checkpoint_fills, update.kv_stores, update.kv_unlinks = kv.disk.take()
        if kv.host_checkpoints is not None:
            update.checkpoint_saves, update.checkpoint_loads = kv.host_checkpoints.take_transfers()
        return update
