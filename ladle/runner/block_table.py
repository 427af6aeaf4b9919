"""The runner's block tables on the host, a row per running request (vLLM's persistent BlockTable).

Rebuilding a step's [requests, blocks] table from Python lists costs O(requests x context / block_size) every
step: about 2 ms at 256 decodes of 2K tokens, 8 ms at 8K, which a CUDA-graph decode step of an 8B model
would spend idle. Here a request's row is written when the runner takes the request and then only where its
table grows (one block every block_size tokens), and a step takes its rows with one index_select. The runner
owns the rows (one per request it holds, the same index in every group's buffer) and frees a row when its
request finishes or is preempted.
"""
from __future__ import annotations

import torch


class BlockTableBuffer:
    def __init__(self, max_rows: int, max_blocks: int) -> None:
        self.table = torch.zeros(max_rows, max_blocks, dtype=torch.int32)

    @property
    def max_rows(self) -> int:
        return self.table.shape[0]

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        """Entries start.. of row `row` become `blocks`."""
        if start + len(blocks) > self.table.shape[1]:
            raise ValueError(f"a table of {start + len(blocks)} blocks exceeds the buffer's {self.table.shape[1]}")
        if blocks:
            self.table[row, start : start + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), width] int32, a new tensor: row i is row rows[i]'s first `width` entries (entries past a
        request's own table are stale or zero; attention never reads past a context length)."""
        return self.table[:, :width].index_select(0, rows)
