"""What the kernels read about one step: each KV cache group's attention inputs, what every group shares, and
each state layer's rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """What every KV cache group's metadata shares in one step (vLLM's name)."""

    cu_seqlens_q: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    query_lens: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class AttentionMetadata:
    """One KV cache group's attention inputs, as every kernel reads them. A backend builds a subclass of its own
    that also names it (ladle.attention.backend.BackendMetadata); tests and benchmarks that call a kernel alone
    build this one by hand."""

    slot_mapping: torch.Tensor  # [T] int64: pool slot of each new token
    cu_seqlens_q: torch.Tensor  # [B+1] int32: new tokens of request i are rows cu[i]:cu[i+1]
    context_lens: torch.Tensor  # [B] int32: KV length of request i after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows padded with 0
    query_lens: tuple[int, ...]  # host copies, so a CPU backend can loop without device syncs
    context_lens_host: tuple[int, ...]
    block_size: int
    sliding_window: int | None = None  # a query at position p reads keys (p - W, p] only

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass(frozen=True)
class StateMetadata:
    """What a layer with a per-request state (ladle.kv_cache.specs.StateSpec) needs about one step: each
    request's slot in the state tensors, its rows, and whether it continues a state or starts afresh."""

    slots: torch.Tensor  # [B] int64, on the device
    slots_host: tuple[int, ...]
    cu_seqlens: torch.Tensor  # [B+1] int64, on the device
    cu_seqlens_cpu: torch.Tensor  # the same on the host, for kernels that plan their launch from it
    cu_seqlens_host: tuple[int, ...]  # [B+1]: the new tokens of request i are rows cu[i]:cu[i+1]
    has_initial_state: tuple[bool, ...]  # False for a request's first chunk: its state starts at zero
    # Speculative decoding: per request, the state rows that keep its state after each of its first new tokens
    # (empty where it has no drafts). Such a request's rows are stepped one token at a time, as decodes are.
    draft_rows: tuple[tuple[int, ...], ...] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.slots_host)

    def decodes(self) -> list[int]:
        """The requests whose one new row continues their state: batched single steps, not chunks."""
        cu = self.cu_seqlens_host
        return [i for i in range(self.num_seqs) if cu[i + 1] - cu[i] == 1 and self.has_initial_state[i]]

    def drafting(self) -> list[int]:
        """The requests whose rows are a decode token and its drafts, each state kept (draft_rows)."""
        return [] if self.draft_rows is None else [i for i, rows in enumerate(self.draft_rows) if rows]
