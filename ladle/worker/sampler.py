"""Turns one step's logits into next tokens (and logprobs), following vLLM's sampling semantics.

Pipeline per row: raw logprobs -> min_tokens -> repetition / frequency / presence penalties
-> greedy argmax, or temperature -> top_k -> top_p -> min_p -> multinomial draw.

A row whose distribution is unusable (NaN logits, every token masked, or a sampling distribution that is not
finite) gets the token id FAILED instead of an exception, so one request's bad row cannot fail the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.outputs import Logprob
from ladle.sampling_params import SamplingParams

_NEG_INF = float("-inf")
FAILED = -1  # the token id of a row that could not be sampled
_F32_MAX = torch.finfo(torch.float32).max


@dataclass
class SamplingMetadata:
    """Built once per step by the model runner; one entry per sampled row, in logits order."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # seeded requests own a generator (on the logits' device)
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # tokens generated so far by each request
    stop_token_ids: list[frozenset[int]]  # eos (unless ignore_eos) + params.stop_token_ids


@dataclass
class SamplerOutput:
    token_ids: list[int]  # FAILED where the row could not be sampled
    logprobs: list[dict[int, Logprob] | None]  # None where params.logprobs is None or the row failed


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] float32 occurrence counts, built with one scatter instead of per-token loops."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)
    if width:
        # Padding points at an extra scratch column so ragged rows fit one tensor.
        ids = torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        token_ids = self.sample(logits, meta)
        ids = token_ids.tolist()
        logprobs = self._logprobs(logits, token_ids.clamp_min(0), meta.params)
        return SamplerOutput(ids, [None if t == FAILED else lp for t, lp in zip(ids, logprobs)])

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Next token ids [rows] on the logits' device (FAILED for unusable rows); no device-to-host sync."""
        if logits.dim() != 2 or logits.shape[0] != len(meta.params):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(meta.params)} sampled rows")
        return self._sample(self._apply_constraints(logits, meta), meta)

    @staticmethod
    def deferrable(meta: SamplingMetadata) -> bool:
        """True when sampling needs nothing the host learns only from this step's tokens: no logprobs to
        read back, and no penalties or min_tokens that count the tokens generated so far (a step launched
        before its predecessor's tokens are read would count one too few)."""
        return all(
            p.logprobs is None and p.min_tokens == 0 and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0 for p in meta.params
        )

    # ---- logit processing (greedy and random rows alike) ----

    def _apply_constraints(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Returns logits with min_tokens and penalties applied; the caller's tensor itself when none apply."""
        vocab = logits.shape[1]
        out = logits

        # min_tokens: one index_put over all (row, stop token) pairs that are still blocked.
        block_rows: list[int] = []
        block_cols: list[int] = []
        for i, p in enumerate(meta.params):
            if len(meta.output_token_ids[i]) < p.min_tokens:
                for t in meta.stop_token_ids[i]:
                    if 0 <= t < vocab:
                        block_rows.append(i)
                        block_cols.append(t)
        if block_rows:
            out = logits.to(torch.float32, copy=True)
            idx = (torch.tensor(block_rows, device=out.device), torch.tensor(block_cols, device=out.device))
            out.index_put_(idx, torch.tensor(_NEG_INF, device=out.device))

        pen_rows = [
            i for i, p in enumerate(meta.params)
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ]
        if pen_rows:
            if out is logits:
                out = logits.to(torch.float32, copy=True)
            out[pen_rows] = self._penalize(out[pen_rows], [meta.params[i] for i in pen_rows],
                                           [meta.prompt_token_ids[i] for i in pen_rows],
                                           [meta.output_token_ids[i] for i in pen_rows])
        return out

    @staticmethod
    def _penalize(x: torch.Tensor, params: list[SamplingParams],
                  prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
        vocab, dev = x.shape[1], x.device
        out_counts = _token_counts(outputs, vocab, dev)

        if any(p.repetition_penalty != 1.0 for p in params):  # decided on the host: no device sync
            rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
            # Repetition penalty (HF/vLLM) looks at prompt and output; the OpenAI-style ones at output only.
            seen = (out_counts > 0) | (_token_counts(prompts, vocab, dev) > 0)
            # A tiny penalty can push a logit past float32's range; +inf would make the softmax NaN, so the
            # boost stops at the largest float (-inf stays: a token penalized out of existence).
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x).clamp(max=_F32_MAX)

        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
        return x - freq * out_counts - pres * (out_counts > 0).float()

    # ---- sampling ----

    def _sample(self, x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        params = meta.params
        greedy = [p.greedy for p in params]
        # amax propagates NaN, and is -inf only when every token is masked: one reduction finds both.
        row_max = x.amax(dim=-1)
        failed = torch.isnan(row_max) | (row_max == _NEG_INF)
        if all(greedy):
            return x.argmax(dim=-1).masked_fill_(failed, FAILED)  # fast path: first max wins, like HF greedy

        out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        if greedy_rows:
            out[greedy_rows] = x[greedy_rows].argmax(dim=-1)

        rand_rows = [i for i, g in enumerate(greedy) if not g]
        rand_x = x if not greedy_rows else x[rand_rows]
        probs = self._probs(rand_x.float(), [params[i] for i in rand_rows])
        # E.g. an inf logit after a tiny repetition penalty makes the softmax NaN; multinomial would raise for
        # the whole batch, so such a row draws from a placeholder and is marked failed instead.
        mass = probs.sum(dim=-1)
        unusable = ~torch.isfinite(mass) | (mass <= 0)
        probs = probs.masked_fill(unusable[:, None], 1.0)
        if greedy_rows:
            failed[rand_rows] |= unusable
        else:
            failed |= unusable

        unseeded = [j for j, i in enumerate(rand_rows) if meta.generators[i] is None]
        if unseeded:
            out[[rand_rows[j] for j in unseeded]] = torch.multinomial(probs[unseeded], 1).squeeze(1)
        for j, i in enumerate(rand_rows):
            gen = meta.generators[i]
            if gen is not None:
                # A draw from the request's own generator on its own row keeps seeded output batch-independent.
                out[i] = torch.multinomial(probs[j : j + 1], 1, generator=gen)[0, 0]
        return out.masked_fill_(failed, FAILED)

    @staticmethod
    def _probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then top_k, top_p, min_p (HF warper order); returns unnormalized sampling weights."""
        vocab, dev = x.shape[1], x.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)[:, None]
        x = (x / temps).clamp(max=_F32_MAX)  # finite as above: huge logits over a small temperature

        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        use_k = any(k < vocab for k in top_k)
        use_p = any(p < 1.0 for p in top_p)
        if use_k or use_p:
            sorted_x, order = x.sort(dim=-1, descending=True)
            if use_k:
                k = torch.tensor(top_k, dtype=torch.long, device=dev)[:, None]
                # Threshold on the k-th value, so ties with it survive (as in vLLM and HF).
                kth = sorted_x.gather(1, k - 1)
                x = x.masked_fill(x < kth, _NEG_INF)
                sorted_x = sorted_x.masked_fill(sorted_x < kth, _NEG_INF)
            if use_p:
                p = torch.tensor(top_p, dtype=torch.float32, device=dev)[:, None]
                sorted_probs = sorted_x.softmax(dim=-1)
                # Drop a token once the mass strictly before it already reaches top_p; the top token
                # always has zero mass before it. Rows with top_p == 1 are exempt from rounding noise.
                drop_sorted = ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= p) & (p < 1.0)
                drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
                x = x.masked_fill(drop, _NEG_INF)

        probs = x.softmax(dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            m = torch.tensor(min_p, dtype=torch.float32, device=dev)[:, None]
            # Ratio to the max is unchanged by renormalization, so no re-softmax is needed.
            probs = probs.masked_fill(probs < m * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    # ---- logprobs ----

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                  params: list[SamplingParams]) -> list[dict[int, Logprob] | None]:
        result: list[dict[int, Logprob] | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return result
        vocab = logits.shape[1]
        # Raw model distribution: before penalties, temperature and masking, as vLLM reports by default.
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        sampled = token_ids[rows][:, None]
        sampled_lp = lp.gather(1, sampled)
        sampled_rank = (lp > sampled_lp).sum(dim=-1) + 1

        wants = [min(params[i].logprobs or 0, vocab) for i in rows]
        n = max(wants)
        top_vals = top_ids = top_ranks = None
        if n:
            top_vals, top_ids = lp.topk(n, dim=-1)  # sorted, so everything above a value sits before it
            top_ranks = (top_vals[:, None, :] > top_vals[:, :, None]).sum(dim=-1) + 1

        s_ids, s_lp, s_rank = sampled[:, 0].tolist(), sampled_lp[:, 0].tolist(), sampled_rank.tolist()
        t_ids = top_ids.tolist() if top_ids is not None else None
        t_vals = top_vals.tolist() if top_vals is not None else None
        t_ranks = top_ranks.tolist() if top_ranks is not None else None
        for j, i in enumerate(rows):
            d = {s_ids[j]: Logprob(logprob=s_lp[j], rank=s_rank[j])}  # sampled token first, as vLLM orders it
            for c in range(wants[j]):
                d.setdefault(t_ids[j][c], Logprob(logprob=t_vals[j][c], rank=t_ranks[j][c]))
            result[i] = d
        return result
