"""Each penalized request's token counts, kept on the device and updated as its tokens come back."""
from __future__ import annotations

import torch


class PenaltyCounts:
    """Each penalized request's output token counts and prompt-token mask, on the device, updated with each
    step's new tokens: a step reads them with one gather instead of counting every token it has generated.

    max_rows rows (the plan reserves max_num_seqs x vocab x 5 bytes: PENALTY_BYTES_PER_TOKEN), allocated
    whole when the first request with a penalty arrives, so an engine without penalties holds none."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device) -> None:
        self.max_rows, self.vocab, self.device = max_rows, vocab, device
        self.counts: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None
        self.free = list(range(max_rows - 1, -1, -1))

    def take(self) -> int | None:
        """A free row, or None when every row is held."""
        if self.counts is None:
            self.counts = torch.zeros(self.max_rows, self.vocab, dtype=torch.float32, device=self.device)
            self.prompt = torch.zeros(self.max_rows, self.vocab, dtype=torch.bool, device=self.device)
        return self.free.pop() if self.free else None

    def fill(self, row: int, prompt: list[int], output: list[int]) -> None:
        """Row `row` holds this request's tokens from now on."""
        assert self.counts is not None and self.prompt is not None
        self.counts[row] = 0.0
        self.prompt[row] = False
        if prompt:
            self.prompt[row, torch.tensor(prompt, dtype=torch.long).to(self.device)] = True
        self.count([row] * len(output), output)

    def release(self, row: int) -> None:
        self.free.append(row)

    def count(self, rows: list[int], tokens: list[int]) -> None:
        """Add one occurrence of tokens[i] to rows[i], all at once."""
        if rows:
            assert self.counts is not None
            index = torch.tensor([rows, tokens], dtype=torch.long).to(self.device)
            self.counts.index_put_((index[0], index[1]), torch.ones(len(rows), device=self.device),
                                   accumulate=True)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.counts is not None and self.prompt is not None
        return self.counts.index_select(0, rows), self.prompt.index_select(0, rows)


PENALTY_BYTES_PER_TOKEN = 5  # a float32 count and a bool prompt flag per vocabulary entry and row
