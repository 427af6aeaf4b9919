"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) from a step's hidden states.

A prefill chunk of a request covers positions [start, start + n); the hidden state at position p gives the
distribution of the token at p + 1, so the chunk yields the entries of prompt positions start + 1 up to
min(start + n, P - 1) (the last prompt position's row predicts the first generated token, which the sampler
draws). Each row attends to the KV carried over from the chunks before it, so the entries are the same
whatever the chunking.

Memory: the head and the log_softmax run over at most `slice_rows` rows at a time ([rows, vocab] logits and
their log-probabilities, then freed), never [chunk x vocab]. The runner passes max_num_seqs, the most sampled
rows a step may have: the plan's activation model reserves that many rows of logits with the costliest
sampling path (a full sort and top-20 logprobs per row), which costs more per row than a slice's logits,
log_softmax and rank comparison (see tests/test_prompt_logprobs.py, which measures a step with both).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from ladle.outputs import Logprob
from ladle.runner.payload import ChunkSpec
from ladle.runner.runner_requests import RunnerRequests
from ladle.runner.sampler import logprob_dicts


class PromptChunk(NamedTuple):
    """The rows of one chunk that predict prompt tokens."""

    request_id: str
    row: int  # the step's hidden row of the chunk's first position
    first: int  # the prompt position of the first target (the chunk's start + 1)
    targets: list[int]  # the prompt tokens those rows predict, in order
    top: int  # the request's prompt_logprobs, at most the vocabulary


class _Head(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...


def prompt_chunks(requests: RunnerRequests, specs: list[ChunkSpec], vocab: int) -> list[PromptChunk]:
    """The step's chunks whose rows predict prompt tokens of a request that wants prompt logprobs. A request
    back with tokens it generated (a preemption) delivered them with its first token: it computes none."""
    out: list[PromptChunk] = []
    if not requests.want_prompt_logprobs:
        return out  # the common step: nothing to look at
    row = 0
    for s in specs:
        r = requests[s.request_id]
        top = r.params.prompt_logprobs
        end = min(s.start_pos + s.num_tokens, len(r.prompt) - 1)  # positions [start, end) predict prompt tokens
        if top is not None and not r.output and end > s.start_pos:
            out.append(PromptChunk(s.request_id, row, s.start_pos + 1, r.prompt[s.start_pos + 1 : end + 1],
                                   min(top, vocab)))
        row += s.num_tokens
    return out


def compute_prompt_logprobs(model: _Head, hidden: torch.Tensor, chunks: list[PromptChunk],
                            slice_rows: int) -> dict[str, tuple[int, list[dict[int, Logprob]]]]:
    """Per request: (its first target's prompt position, an entry per target). On a tensor-parallel rank other
    than the driver the head's collectives run the same slices and nothing comes back."""
    rows = torch.cat([torch.arange(c.row, c.row + len(c.targets)) for c in chunks]).to(hidden.device)
    targets = torch.tensor([t for c in chunks for t in c.targets], device=hidden.device)
    tops = [c.top for c in chunks for _ in c.targets]
    entries: list[dict[int, Logprob]] = []
    for lo in range(0, len(tops), max(1, slice_rows)):
        hi = min(lo + max(1, slice_rows), len(tops))
        logits = model.compute_logits(hidden.index_select(0, rows[lo:hi]))
        if logits is None:
            continue
        # The raw distribution, as vLLM reports it (and as for sampled logprobs).
        lp = torch.log_softmax(logits.float(), dim=-1)
        del logits
        entries += logprob_dicts(lp, targets[lo:hi], tops[lo:hi])
    if not entries:
        return {}
    out, at = {}, 0
    for c in chunks:
        out[c.request_id] = (c.first, entries[at : at + len(c.targets)])
        at += len(c.targets)
    return out
