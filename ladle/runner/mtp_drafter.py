"""Drafts from the model's own multi-token-prediction layer (speculative_config method `mtp`), made in the step
whose tokens they follow, from that step's hidden states.

Every step writes the MTP layer's K/V at all of its positions, prefill chunks included, so its KV cache holds every
position whatever the chunking (a chunk that samples nothing reads the prompt's next token; a decode row's position
after its last accepted draft reads the token sampled there; positions of rejected drafts are written over by the
next step). Only K/V: no position of a step reads the MTP layer's output but a drafting row's last kept one, which
runs the whole layer as a one-token query. A sampled row the engine asks n drafts of (ChunkSpec.num_proposals, gated
by what drafts pay) then drafts: draft 1 from the MTP output at its last kept position, each further one from the
MTP layer run on the previous draft and output one position on. Those runs write the MTP cache up to n - 1 positions
past the row's next token; the scheduler allocates them where the pool has room, and a row whose table ends earlier
drafts fewer tokens. Where drafts have not paid at a batch size for a while, the engine rests the layer altogether
(ChunkSpec.num_proposals -1), its cache included.

A prefix-cache hit of h tokens brings the MTP cache of its positions too; the entry at h - 1 was written with the
token that followed it in the request that computed it, which a request with another token at h does not share.
That one entry may differ from a cold run's; every other one reads only tokens inside the hit. (vLLM drops the
last block of a hit when a drafter runs, recomputing it; here a hit of a stateful model lands on a checkpoint, so
that would cost a checkpoint interval, not a block.) Drafts only change how many tokens a step may accept, never
which: verification (ladle.runner.spec_verify) keeps the target's samples.

Not in the activation profile, and bounded by it: the cache writes hold the step's hidden states and one of the
MTP layer's inputs and projections at a time, less than one of the model's own layers did in that forward; the
draft runs are one token a sampled row.
"""
from __future__ import annotations

import numpy as np
import torch

from ladle.attention.backend import BackendMetadata
from ladle.attention.groups import AttentionGroup
from ladle.kv_cache.specs import layer_groups
from ladle.models.interface import SupportsMtp
from ladle.runner.inputs import StepInputs, build_step_inputs
from ladle.runner.payload import ChunkSpec
from ladle.runner.runner_requests import RunnerRequests
from ladle.runner.step_batch import StepBatch
from ladle.runner.step_buffers import StepBuffers


class MtpDrafter:
    def __init__(self, model: SupportsMtp, num_speculative_tokens: int, block_size: int, device: torch.device,
                 groups: tuple[AttentionGroup, ...], requests: RunnerRequests) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.groups = groups
        self.requests = requests
        specs = model.cache_specs(torch.float32)  # the MTP layer's cache is the last layer of them
        self.layer = len(specs) - 1
        self.group = layer_groups(specs)[self.layer]
        self.buffers = StepBuffers(device)  # the draft runs' inputs, apart from the step's

    @torch.inference_mode()
    def propose(self, kv_caches: list[tuple[torch.Tensor, ...]], specs: list[ChunkSpec], batch: StepBatch,
                inputs: StepInputs, hidden: torch.Tensor,
                kept: dict[str, tuple[int, int]]) -> dict[str, tuple[int, ...]]:
        """The next step's drafts of each sampled row of this step, which ran specs as batch into hidden. kept:
        each sampled row's (accepted drafts, sampled token); a row whose sample failed is not in it."""
        if specs[0].num_proposals < 0:  # the engine rests the layer this step (Speculator.proposals)
            return {}
        next_ids = np.zeros(len(batch.token_ids), dtype=np.int64)  # a rejected draft's position reads 0
        rows: list[tuple[str, int, int]] = []  # (request, index of its last kept position, drafts wanted)
        positions: list[int] = []  # of those positions
        start = 0
        for s, n in zip(specs, batch.num_tokens):
            next_ids[start : start + n - 1] = batch.token_ids[start + 1 : start + n]
            req = self.requests[s.request_id]
            got = kept.get(s.request_id) if s.sample else None
            if not s.sample:  # a chunk that samples nothing continues with the prompt
                next_ids[start + n - 1] = req.token_at(s.start_pos + n)
            elif got is None:  # its sample failed, so it ends: nothing to draft
                next_ids[start + n - 1] = 0
            else:
                accepted, token = got
                at = start + n - 1 - len(s.draft_token_ids) + accepted
                next_ids[at] = token
                if s.num_proposals > 0:
                    rows.append((s.request_id, at, min(s.num_proposals, self.k)))
                    positions.append(s.start_pos + at - start)
            start += n
        ids = torch.from_numpy(next_ids).to(self.device)
        self.model.mtp_forward(ids, inputs.positions, hidden, kv_caches[self.layer], self._attn(inputs),
                               write_only=True)
        if not rows:
            return {}
        kept_at = [r[1] for r in rows]
        last = self._run_on([r[0] for r in rows], next_ids[kept_at].tolist(), positions,
                            hidden[torch.tensor(kept_at, device=self.device)], kv_caches)
        drafts = [[t] for t in self._argmax(last)]
        live = list(range(len(rows)))  # the rows `last` holds the MTP output of, in its order
        for step in range(1, self.k):
            positions = [p + 1 for p in positions]
            keep = [j for j, i in enumerate(live) if rows[i][2] > step and self._has_room(rows[i][0], positions[i])]
            if not keep:
                break
            if len(keep) < len(live):
                last = last[torch.tensor(keep, device=self.device)]
                live = [live[j] for j in keep]
            last = self._run_on([rows[i][0] for i in live], [drafts[i][-1] for i in live],
                                [positions[i] for i in live], last, kv_caches)
            for i, t in zip(live, self._argmax(last)):
                drafts[i].append(t)
        return {rows[i][0]: tuple(d) for i, d in enumerate(drafts)}

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        logits = self.model.mtp_logits(hidden)
        assert logits is not None  # None only on a tensor-parallel rank other than the driver; mtp runs without
        return logits.argmax(dim=-1).tolist()

    def _attn(self, inputs: StepInputs) -> BackendMetadata:
        attn = inputs.attn_groups[self.group]
        assert isinstance(attn, BackendMetadata)  # the MTP layer's cache is a paged layer's
        return attn

    def _has_room(self, request_id: str, position: int) -> bool:
        """Whether the request's table reaches this position (the draft run writes the MTP cache there)."""
        return len(self.requests[request_id].tables[self.group]) * self.block_size > position

    def _run_on(self, request_ids: list[str], tokens: list[int], positions: list[int], hidden: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """One MTP position per row: token at position, after hidden (the row's previous MTP output)."""
        reqs = [self.requests[r] for r in request_ids]
        batch = StepBatch(tokens, positions, [1] * len(tokens), [True] * len(tokens), [r.tables for r in reqs],
                          [-1] * len(tokens))
        tables = self.requests.tables([ChunkSpec(r, p, 1, True) for r, p in zip(request_ids, positions)],
                                      self.block_size)
        inputs = build_step_inputs(batch, self.block_size, self.device, tables, self.groups, 0, self.buffers)
        out = self.model.mtp_forward(inputs.input_ids, inputs.positions, hidden, kv_caches[self.layer],
                                     self._attn(inputs))
        assert out is not None  # None only with write_only
        return out
