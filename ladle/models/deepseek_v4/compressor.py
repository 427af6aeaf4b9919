"""DeepSeek-V4's KV compressors: every `rate` tokens become one compressed KV entry, a softmax-gated sum of
their projections. Heavily-compressed layers (HCA, rate 128) gate one window at a time; compressed-sparse
layers (CSA, rate 4) and their Lightning Indexer overlap two windows (the previous window's "a" half and this
window's "b" half of a 2x-wide projection).

What a request carries from one chunk to the next, per compressor:
- in its state slot, the projected kv and gate of the tokens of the group not complete yet (position % rate
  of them) and, with overlap, the projections of the last complete window (its "a" half feeds the next entry);
- in the paged pool, the entries emitted so far, entry e at block e // per_block of the request's table in the
  compressor's own KV cache group (compress_rate tokens per entry).
So any split of a prompt into chunks emits the same entries as one pass (HF's DeepseekV4HCACache/CSACache
carry the same quantities between generate calls).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ladle.attention.metadata import AttentionMetadata, StateMetadata


def entry_slots(table: torch.Tensor, start: int, stop: int, per_block: int) -> torch.Tensor:
    """Pool rows of entries [start, stop) of one request whose block table row is `table`."""
    e = torch.arange(start, stop, device=table.device)
    return table[e // per_block].long() * per_block + e % per_block


class Dsv4RMSNorm(nn.Module):
    """RMSNorm whose weight multiplies in fp32 before the cast back (DeepSeek-V4 keeps norm weights fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x [T, ..., D] by consecutive pairs (DeepSeek-V4's
    interleaved rope); cos/sin [T, pairs] are broadcast over the middle dims. Computed in fp32, like HF."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    for _ in range(x.dim() - 2):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    nope, rope = x[..., :-rot], x[..., -rot:]
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((nope, (rope.float() * cos + half.float() * sin).to(x.dtype)), dim=-1)


class Compressor(nn.Module):
    """One compressor: `wkv`, `wgate` and `ape` (the per-slot gate bias) as the checkpoint names them."""

    def __init__(self, config: Any, rate: int, dim: int, overlap: bool) -> None:
        super().__init__()
        self.rate, self.dim, self.overlap = rate, dim, overlap
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(config.hidden_size, width, bias=False)
        self.wgate = nn.Linear(config.hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width))
        self.norm = Dsv4RMSNorm(dim, config.rms_norm_eps)

    def state_shapes(self) -> list[tuple[int, ...]]:
        """Its slot tensors: pending kv, pending gate[, last window kv, last window gate]."""
        width = 2 * self.dim if self.overlap else self.dim
        return [(self.rate, width)] * (4 if self.overlap else 2)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata,
                positions_host: list[int], rope: Any, pool: torch.Tensor, paged: AttentionMetadata,
                per_block: int) -> list[int]:
        """Project the step's rows x [T, hidden], emit every entry whose group completes into pool ([rows,
        dim], per_block rows to a block of `paged`'s tables), and write pending projections back. Returns each
        request's entry count after the step."""
        kv_all, gate_all = self.wkv(x), self.wgate(x)
        pend_kv, pend_gate = state[0], state[1]
        counts = []
        cu = meta.cu_seqlens_host
        for i, slot in enumerate(meta.slots_host):
            start = positions_host[cu[i]]
            held = start % self.rate if meta.has_initial_state[i] else 0
            kv = torch.cat((pend_kv[slot, :held], kv_all[cu[i] : cu[i + 1]]))
            gate = torch.cat((pend_gate[slot, :held], gate_all[cu[i] : cu[i + 1]]))
            first = (start - held) // self.rate  # the first window this step may complete
            if meta.draft_rows is not None and meta.draft_rows[i]:
                self._keep_drafts(kv, gate, held, meta.draft_rows[i], state, slot)
            windows = kv.shape[0] // self.rate
            if windows:
                used = windows * self.rate
                wkv = kv[:used].view(windows, self.rate, -1)
                wgate = gate[:used].view(windows, self.rate, -1)
                rows = entry_slots(paged.block_tables[i], first, first + windows, per_block)
                pool[rows] = self._emit(wkv, wgate, first, state, slot, rope)
                if self.overlap:
                    state[2][slot], state[3][slot] = wkv[-1], wgate[-1]
            rest = kv.shape[0] - windows * self.rate
            pend_kv[slot, :rest], pend_gate[slot, :rest] = kv[kv.shape[0] - rest :], gate[gate.shape[0] - rest :]
            counts.append((start + cu[i + 1] - cu[i]) // self.rate)
        return counts

    def _keep_drafts(self, kv: torch.Tensor, gate: torch.Tensor, held: int, keep: tuple[int, ...],
                     state: tuple[torch.Tensor, ...], slot: int) -> None:
        """Speculative decoding: the state after each of a drafting row's first len(keep) tokens, in its draft
        rows (a rejected draft rolls the slot back to one): the pending projections of the group not complete
        then and, with overlap, the last window complete then (this step's, or the one the slot holds now).
        kv, gate: the held pending rows, then the step's."""
        for j, row in enumerate(keep):
            n = held + j + 1  # rows of kv up to and including token j
            rest = n % self.rate
            state[0][row, :rest], state[1][row, :rest] = kv[n - rest : n], gate[n - rest : n]
            if self.overlap:
                w = n // self.rate
                if w:
                    window = slice((w - 1) * self.rate, w * self.rate)
                    state[2][row], state[3][row] = kv[window], gate[window]
                else:
                    state[2][row], state[3][row] = state[2][slot], state[3][slot]

    def _emit(self, kv: torch.Tensor, gate: torch.Tensor, first: int, state: tuple[torch.Tensor, ...], slot: int,
              rope: Any) -> torch.Tensor:
        """Entries of complete windows kv/gate [n, rate, width], the first of them window `first`."""
        gate = gate + self.ape
        n, rate, d = kv.shape[0], self.rate, self.dim
        if self.overlap:
            # Entry w gates window w-1's "a" half together with window w's "b" half over 2 * rate slots.
            both_kv = kv.new_zeros((n, 2 * rate, d))
            both_gate = gate.new_full((n, 2 * rate, d), float("-inf"))
            both_kv[:, rate:], both_gate[:, rate:] = kv[..., d:], gate[..., d:]
            both_kv[1:, :rate], both_gate[1:, :rate] = kv[:-1, :, :d], gate[:-1, :, :d]
            if first > 0:  # window first-1 completed in an earlier step: its projections are in the state
                both_kv[0, :rate] = state[2][slot][:, :d]
                both_gate[0, :rate] = (state[3][slot] + self.ape)[:, :d].to(both_gate.dtype)
            kv, gate = both_kv, both_gate
        out = self.norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        positions = (torch.arange(n, device=kv.device) + first) * rate
        cos, sin = rope(positions, out.dtype)
        return interleaved_rope(out, cos, sin)


class Indexer(nn.Module):
    """The Lightning Indexer of a CSA layer: its own overlapping compressor at index_head_dim, and a score
    `sum_h w_{t,h} relu(q_{t,h} . k_s)` that keeps each query's top index_topk complete entries."""

    def __init__(self, config: Any, rate: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.top_k = config.index_n_heads, config.index_head_dim, config.index_topk
        self.rate = rate
        self.compressor = Compressor(config, rate, self.head_dim, overlap=True)
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, positions: torch.Tensor, block: int) -> torch.Tensor:
        """One request's rows -> [t, min(top_k, entries)] the entries each query attends, -1 where it has fewer
        complete entries than that. Scored `block` queries at a time, so the scores stay [block, heads,
        entries] however long the chunk.

        Ties are broken towards the earlier entry, so the choice depends on the scores alone, never on how
        many entries the step holds (HF's topk picks among ties arbitrarily)."""
        t = x.shape[0]
        picks = torch.full((t, min(self.top_k, keys.shape[0])), -1, dtype=torch.long, device=x.device)
        if picks.shape[1] == 0:
            return picks
        q = interleaved_rope(self.wq_b(q_residual).view(t, self.num_heads, self.head_dim), cos, sin)
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        complete = (positions + 1) // self.rate  # query p sees entries whose group ended at or before p
        for b in range(0, t, block):
            rows = slice(b, min(t, b + block))
            seen = int(complete[rows.stop - 1])
            scores = torch.einsum("thd,sd->ths", q[rows].float(), keys[:seen].float())
            scores = (torch.relu(scores) * self.head_dim**-0.5 * weights[rows, :, None]).sum(dim=1)
            future = torch.arange(seen, device=x.device)[None, :] >= complete[rows, None]
            kept = _top_k_earliest(scores.masked_fill(future, float("-inf")), picks.shape[1])
            picks[rows, : kept.shape[1]] = torch.where(kept < complete[rows, None], kept, -1)
        return picks


def _top_k_earliest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of each row's k largest scores, ties at the k-th broken towards the earlier index. topk, and a
    stable sort only for the rows whose k-th score is a finite tie that topk may have split."""
    k = min(k, scores.shape[1])
    values, kept = scores.topk(k, dim=-1)
    kth = values[:, -1:]
    split = torch.isfinite(kth[:, 0]) & ((scores == kth).sum(-1) > (values == kth).sum(-1))
    if bool(split.any()):
        kept[split] = scores[split].sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return kept
