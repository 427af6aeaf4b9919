"""The runner's copy of the requests it runs: taken whole from the engine's StateUpdate (ladle.runner.payload),
then given new blocks by it while the runner appends the tokens it samples itself. Tokens and sampling state,
each request's row in the persistent block tables and in the penalty counts, and each step's columns
(StepBatch) built from them in one pass.

Rows are held only by requests the engine runs: a finished, aborted, preempted or restarted request is
removed (and comes back whole as a new request if it runs again), so max_num_seqs rows always suffice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.runner.block_table import BlockTableBuffer
from ladle.runner.payload import ChunkSpec, NewTokens, StateUpdate
from ladle.runner.penalty_counts import PenaltyCounts
from ladle.runner.sampling_batch import penalized
from ladle.runner.step_batch import StepBatch
from ladle.sampling_params import SamplingParams


@dataclass
class RunnerRequest:
    prompt: list[int]
    output: list[int]  # generated tokens (kept apart, so penalties read them without a copy each step)
    params: SamplingParams
    stop_token_ids: frozenset[int]
    tables: tuple[list[int], ...]  # per KV cache group; entries a window gave back may be stale (never read)
    state_slot: int = -1  # its slot in the state layers (models with StateSpec layers)
    row: int = -1  # its row in the block-table buffers (the same in every group's)
    penalty_row: int = -1  # its row in the penalty counts, once it has sampled with a penalty

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_at(self, pos: int) -> int:
        p = len(self.prompt)
        return self.prompt[pos] if pos < p else self.output[pos - p]

    def tokens(self, start: int, n: int) -> list[int]:
        """Tokens [start, start + n) of prompt + output."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p : start - p + n]
        if start + n <= p:
            return self.prompt[start : start + n]
        return self.prompt[start:] + self.output[: start + n - p]


class RunnerRequests:
    def __init__(self, block_tables: list[BlockTableBuffer] | None, penalties: PenaltyCounts) -> None:
        """block_tables: one buffer per KV cache group (None: each step's tables are built from the lists)."""
        self.block_tables = block_tables
        self.penalties = penalties
        self.requests: dict[str, RunnerRequest] = {}
        rows = block_tables[0].max_rows if block_tables else 0
        self._free_rows = list(range(rows - 1, -1, -1))
        # Changes whenever a request comes or goes, so a cache keyed on request ids never finds a stale one.
        self.version = 0
        self._rows: tuple[tuple[int, tuple[str, ...]], torch.Tensor] | None = None  # the last step's row index
        # Requests still owed their prompt logprobs (none generated yet), so a step without any skips the look.
        self.want_prompt_logprobs: set[str] = set()

    def __getitem__(self, request_id: str) -> RunnerRequest:
        return self.requests[request_id]

    def __len__(self) -> int:
        return len(self.requests)

    def apply(self, update: StateUpdate) -> None:
        """Forget removed requests, take new (or returning) ones, extend the others' block tables."""
        if update.removed or update.new_requests:
            self.version += 1
        for rid in update.removed:
            self._forget(rid)
        for new in update.new_requests:
            self._forget(new.request_id)
            n = new.num_prompt_tokens
            req = RunnerRequest(list(new.token_ids[:n]), list(new.token_ids[n:]), new.sampling_params,
                                new.stop_token_ids, tuple(list(t) for t in new.block_ids), new.state_slot)
            if self.block_tables:
                if not self._free_rows:
                    raise RuntimeError(f"more than {self.block_tables[0].max_rows} requests in the runner at once")
                req.row = self._free_rows.pop()
                for buffer, table in zip(self.block_tables, req.tables):
                    buffer.write(req.row, 0, table)
            self.requests[new.request_id] = req
            if new.sampling_params.prompt_logprobs is not None and not req.output:
                self.want_prompt_logprobs.add(new.request_id)
        for diff in update.diffs:
            req = self.requests[diff.request_id]
            for g, (table, added) in enumerate(zip(req.tables, diff.new_block_ids)):
                if added and self.block_tables:
                    self.block_tables[g].write(req.row, len(table), added)
                table.extend(added)

    def append(self, new: dict[str, NewTokens]) -> None:
        """Append a step's sampled tokens. A request no longer here has ended (a step launched ahead sampled a
        void token for it); one that is here must be exactly as long as the step saw it, or the engine and the
        runner disagree on its tokens, which no output may survive."""
        counted_rows: list[int] = []
        counted: list[int] = []
        requests, want = self.requests, self.want_prompt_logprobs
        for rid, (position, ids) in new.items():
            req = requests.get(rid)
            if req is None:
                continue
            if len(req.prompt) + len(req.output) != position:
                raise RuntimeError(f"request {rid}: the runner holds {req.num_tokens} tokens, but its sampled "
                                   f"tokens go at position {position}")
            req.output.extend(ids)
            if want:
                want.discard(rid)
            if req.penalty_row >= 0:
                counted_rows += [req.penalty_row] * len(ids)
                counted += ids
        if counted:
            self.penalties.count(counted_rows, counted)

    def _forget(self, request_id: str) -> None:
        gone = self.requests.pop(request_id, None)
        self.want_prompt_logprobs.discard(request_id)
        if gone is None:
            return
        if gone.row >= 0:
            self._free_rows.append(gone.row)
        if gone.penalty_row >= 0:
            self.penalties.release(gone.penalty_row)

    def step_batch(self, specs: list[ChunkSpec], placeholder_inputs: bool = False) -> StepBatch:
        """The step's columns; placeholder_inputs: every request's one input token is still on the device."""
        reqs = [self.requests[s.request_id] for s in specs]
        drafts = None  # a step of one token a row (every decode step without speculation) carries no drafts
        if placeholder_inputs:
            tokens = [0] * len(specs)
        elif all(s.num_tokens == 1 for s in specs):
            tokens = [r.token_at(s.start_pos) for r, s in zip(reqs, specs)]
        else:  # a decode row with drafts: its last known token, then the drafts
            tokens = [t for r, s in zip(reqs, specs)
                      for t in (r.tokens(s.start_pos, s.num_tokens - len(s.draft_token_ids)) + list(s.draft_token_ids)
                                if s.draft_token_ids else r.tokens(s.start_pos, s.num_tokens))]
            counts = [len(s.draft_token_ids) for s in specs]
            drafts = counts if any(counts) else None
        return StepBatch(tokens, [s.start_pos for s in specs], [s.num_tokens for s in specs],
                         [s.sample or placeholder_inputs for s in specs], [r.tables for r in reqs],
                         [r.state_slot for r in reqs], drafts)

    def tables(self, specs: list[ChunkSpec], block_size: int) -> tuple[torch.Tensor, ...] | None:
        """The step's rows of each group's block-table buffer, as wide as its longest context needs."""
        if not self.block_tables:
            return None
        key = (self.version, tuple(s.request_id for s in specs))
        if self._rows is None or self._rows[0] != key:  # the same requests step after step: one index tensor
            self._rows = (key, torch.tensor([self.requests[r].row for r in key[1]], dtype=torch.long))
        rows = self._rows[1]
        width = -(-max(s.start_pos + s.num_tokens for s in specs) // block_size)
        return tuple(buffer.gather(rows, width) for buffer in self.block_tables)

    def penalty_rows(self, reqs: list[RunnerRequest]) -> list[int]:
        """The penalty-count row of each penalized request here, filled from its tokens when it first samples."""
        for req in reqs:
            if penalized(req.params) and req.penalty_row < 0:
                row = self.penalties.take()
                if row is None:
                    raise RuntimeError(f"more than {self.penalties.max_rows} requests with penalties at once")
                self.penalties.fill(row, req.prompt, req.output)
                req.penalty_row = row
        return [r.penalty_row for r in reqs if penalized(r.params)]
