"""Turns one step's logits into next tokens (and logprobs), following vLLM's sampling semantics.

Pipeline per row: raw logprobs -> min_tokens -> repetition / frequency / presence penalties
-> greedy argmax, or temperature -> top_k -> top_p -> min_p -> a draw by inverse CDF from the row's uniform.

Everything a step needs is on the device already (ladle.runner.sampling_batch): no host lists are indexed
and nothing is read back before the tokens themselves. On CPU, where a full sort of a 150K vocabulary costs
about 15 ms a row, top-k / top-p rows sort only their largest candidates when those provably hold every token
the filters keep, and fall back to the full sort otherwise; on CUDA every filtered row takes the full sort,
which needs no such host-side check.

A row whose distribution is unusable (NaN logits, every token masked, or a sampling distribution that is not
finite) gets the token id FAILED instead of an exception, so one request's bad row cannot fail the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.kernels.cpu_kernels import CpuKernels
from ladle.outputs import Logprob
from ladle.runner.payload import FAILED
from ladle.runner.sampling_batch import Filters, FilterSplit, SamplingBatch, SamplingMetadata

_NEG_INF = float("-inf")
_F32_MAX = torch.finfo(torch.float32).max


@dataclass
class SamplerOutput:
    token_ids: list[int]  # FAILED where the row could not be sampled
    logprobs: list[dict[int, Logprob] | None]  # None where params.logprobs is None or the row failed


class Sampler:
    def __init__(self, kernels: CpuKernels | None = None) -> None:
        """kernels: ladle's C kernels, which apply grammar bitmasks to CPU logits (torch ops otherwise)."""
        self.kernels = kernels

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = allowed_only(logits, meta, self.kernels)  # logprobs too see only what the grammar allows
        token_ids = self._tokens(logits, meta)
        ids = token_ids.tolist()
        if meta.batch.logprob_rows is None:
            return SamplerOutput(ids, [None] * len(ids))
        logprobs = _logprobs(logits, token_ids.clamp_min(0), meta.batch)
        return SamplerOutput(ids, [None if t == FAILED else lp for t, lp in zip(ids, logprobs)])

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Next token ids [rows] on the logits' device (FAILED for unusable rows); no device-to-host sync."""
        return self._tokens(allowed_only(logits, meta, self.kernels), meta)

    @staticmethod
    def _tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        b = meta.batch
        if logits.dim() != 2 or logits.shape[0] != b.num_rows or logits.shape[1] != b.vocab:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {b.num_rows} sampled rows of a "
                             f"{b.vocab}-token vocabulary")
        return _sample(_apply_constraints(logits, meta), meta)

    @staticmethod
    def deferrable(meta: SamplingMetadata) -> bool:
        """True when sampling needs nothing the host learns only from this step's tokens: no logprobs to
        read back, and no penalties, whose counts take each token when the host hands it back (a step
        launched before its predecessor's tokens are read would count one too few)."""
        return meta.batch.deferrable


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool from [rows, words] int32 bitmasks (bit t % 32 of word t // 32: token t allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab].bool()


def allowed_only(logits: torch.Tensor, meta: SamplingMetadata, kernels: CpuKernels | None = None) -> torch.Tensor:
    """The logits with every token a constrained row's grammar forbids at -inf, in float32: fp32 logits are
    masked in place (the constrained rows only; a copy of 64 rows of a 152K vocabulary costs more than the
    mask), others converted first; the caller's tensor untouched when no row is constrained. Before penalties,
    temperature and the filters, so every sampling mode draws among allowed tokens only. On CPU with kernels, a
    C loop over the mask's words (a tenth of torch's time: see apply_bitmask.c)."""
    if meta.allowed is None:
        return logits
    rows, words = meta.allowed
    out = logits if logits.dtype == torch.float32 and logits.stride(-1) == 1 else logits.float().contiguous()
    if kernels is not None and out.device.type == "cpu":
        words, rows = words.contiguous(), rows.contiguous()
        kernels.apply_bitmask(out.data_ptr(), out.stride(0), out.shape[1], words.data_ptr(), words.shape[1],
                              rows.data_ptr(), rows.shape[0])
        return out
    sub = out.index_select(0, rows).masked_fill_(~unpack_bitmask(words, out.shape[1]), _NEG_INF)
    return out.index_copy_(0, rows, sub)


def _apply_constraints(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Logits with min_tokens and penalties applied; the caller's tensor itself when none apply."""
    b, out = meta.batch, logits
    if meta.blocked is not None:
        out = logits.to(torch.float32, copy=True)
        out.index_put_(meta.blocked, torch.tensor(_NEG_INF, device=out.device))
    if b.penalized is not None:
        if out is logits:
            out = logits.to(torch.float32, copy=True)
        out.index_copy_(0, b.penalized, _penalize(out.index_select(0, b.penalized), meta))
    return out


def _penalize(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    b, counts = meta.batch, meta.output_counts
    assert counts is not None and meta.prompt_seen is not None
    if b.repetition is not None:
        # Repetition penalty (HF/vLLM) looks at prompt and output; the OpenAI-style ones at output only.
        seen = (counts > 0) | meta.prompt_seen
        # A tiny penalty can push a logit past float32's range; +inf would make the softmax NaN, so the
        # boost stops at the largest float (-inf stays: a token penalized out of existence).
        x = torch.where(seen, torch.where(x > 0, x / b.repetition, x * b.repetition), x).clamp(max=_F32_MAX)
    if b.frequency is not None:
        x = x - b.frequency * counts
    if b.presence is not None:
        x = x - b.presence * (counts > 0).float()
    return x


def _sample(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    b = meta.batch
    # amax propagates NaN, and is -inf only when every token is masked: one reduction finds both (neither
    # NaN nor -inf is above -inf).
    failed = ~(x.amax(dim=-1) > _NEG_INF)
    if b.all_greedy:
        return x.argmax(dim=-1).masked_fill_(failed, FAILED)  # first max wins, like HF greedy
    assert meta.uniforms is not None
    if b.random_rows is None:  # every row draws
        tokens, unusable = _draw(x.float(), b, meta.uniforms)
        return tokens.masked_fill_(failed | unusable, FAILED)
    assert b.greedy_rows is not None  # set together with random_rows
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    out.index_copy_(0, b.greedy_rows, x.index_select(0, b.greedy_rows).argmax(dim=-1))
    tokens, unusable = _draw(x.index_select(0, b.random_rows).float(), b, meta.uniforms)
    out.index_copy_(0, b.random_rows, tokens)
    failed.index_copy_(0, b.random_rows, failed.index_select(0, b.random_rows) | unusable)
    return out.masked_fill_(failed, FAILED)


def _draw(x: torch.Tensor, b: SamplingBatch, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, then top_k, top_p, min_p (HF warper order), then the draw: token ids and unusable rows."""
    assert b.temperature is not None  # set whenever a row draws
    x = (x / b.temperature).clamp(max=_F32_MAX)  # finite as above: huge logits over a small temperature
    split = b.split
    if split is None:
        return _inverse_cdf(_min_p(x.softmax(dim=-1), b.min_p), u, None)
    if split.plain is None:
        return _draw_sorted(x, split, u)
    assert split.filtered is not None
    tokens = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    unusable = torch.empty(x.shape[0], dtype=torch.bool, device=x.device)
    plain = _inverse_cdf(_min_p(x.index_select(0, split.plain).softmax(dim=-1), _rows(b.min_p, split.plain)),
                         u.index_select(0, split.plain), None)
    picked = _draw_sorted(x.index_select(0, split.filtered), split, u.index_select(0, split.filtered))
    for rows, (t, bad) in ((split.plain, plain), (split.filtered, picked)):
        tokens.index_copy_(0, rows, t)
        unusable.index_copy_(0, rows, bad)
    return tokens, unusable


def _draw_sorted(x: torch.Tensor, split: FilterSplit, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with top-k / top-p draw from their logits sorted descending, ties by token id. On CPU each row
    sorts only its `candidates` largest where those provably hold every token its filters keep and no tie
    straddles their edge: a top-k row's survivors (ties with the k-th value included) all fit, a top-p-only
    row's candidates already hold top_p of its mass. Any other row takes the full sort."""
    f, c = split.filters, split.candidates
    if c is None:
        vals, ids = x.sort(dim=-1, descending=True, stable=True)
        return _inverse_cdf(_min_p(_sorted_weights(vals, f, None), f.min_p), u, ids)
    vals, ids = x.topk(c, dim=-1)
    ids, order = ids.sort(dim=-1)  # topk orders ties arbitrarily: by token id first, then a stable sort
    vals, order = vals.gather(1, order).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    lse_full = None if split.all_top_k else x.logsumexp(dim=-1, keepdim=True)
    tokens, unusable = _inverse_cdf(_min_p(_sorted_weights(vals, f, lse_full), f.min_p), u, ids)
    edge = vals[:, -1:]
    exact = (x == edge).sum(dim=-1) == (vals == edge).sum(dim=-1)
    if f.top_k is not None:
        kth = vals.gather(1, (f.top_k - 1).clamp(max=c - 1))
        exact &= (x >= kth).sum(dim=-1) <= c
    if lse_full is not None:  # a row without top-k has a top_p below 1, or it would not be filtered
        assert f.top_p is not None
        holds_top_p = ((vals - lse_full).exp().sum(dim=-1, keepdim=True) >= f.top_p)[:, 0]
        exact = holds_top_p & exact if f.has_top_k is None else torch.where(f.has_top_k[:, 0], exact,
                                                                             holds_top_p & exact)
    if bool(exact.all()):
        return tokens, unusable
    wide = (~exact).nonzero()[:, 0]
    sub = f.rows(wide)
    vals, ids = x.index_select(0, wide).sort(dim=-1, descending=True, stable=True)
    again = _inverse_cdf(_min_p(_sorted_weights(vals, sub, None), sub.min_p), u.index_select(0, wide), ids)
    tokens.index_copy_(0, wide, again[0])
    unusable.index_copy_(0, wide, again[1])
    return tokens, unusable


def _rows(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, index)


def _sorted_weights(vals: torch.Tensor, f: Filters, lse_full: torch.Tensor | None) -> torch.Tensor:
    """Unnormalized probabilities of descending candidates after top-k and top-p. A top-k row renormalizes over
    its survivors, all among the candidates; any other row needs its full row's log-sum-exp (lse_full) unless
    the candidates are the whole vocabulary (None)."""
    if f.top_k is not None:
        # Threshold on the k-th value, so ties with it survive (as in vLLM and HF).
        kth = vals.gather(1, (f.top_k - 1).clamp(max=vals.shape[1] - 1))
        vals = vals.masked_fill(vals < kth, _NEG_INF)
    if lse_full is None:
        weights = vals.softmax(dim=-1)
    else:
        lse = vals.logsumexp(dim=-1, keepdim=True)
        lse = lse_full if f.has_top_k is None else torch.where(f.has_top_k, lse, lse_full)
        weights = (vals - lse).exp()
    if f.top_p is not None:
        # Drop a token once the mass strictly before it already reaches top_p; the top token always has zero
        # mass before it. Rows without top_p hold 2 there, out of rounding noise's reach.
        weights = weights.masked_fill((weights.cumsum(dim=-1) - weights) >= f.top_p, 0.0)
    return weights


def _min_p(probs: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    if min_p is None:
        return probs
    # Ratio to the max is unchanged by renormalization, so unnormalized weights do.
    return probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The token whose cumulative weight first exceeds u x total, per row (a zero-weight token never: the sum
    must rise at it), and which rows have no usable weights (a NaN, or nothing left: weights are at most 1
    each, so the total is finite otherwise). ids: the token id of each column (None: the column is the id).
    u stays below 1 - 2**-20 (SamplingBatch.step), so u x total is below the total even rounded in float32."""
    # float64 sums on CPU cost little; CUDA sums in float32, as torch.multinomial does there.
    cdf = weights.to(torch.float64 if weights.device.type == "cpu" else torch.float32).cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    unusable = ~(total[:, 0] > 0)
    index = torch.searchsorted(cdf, u[:, None].to(cdf.dtype) * total, right=True).clamp_(max=cdf.shape[1] - 1)
    picked = index if ids is None else ids.gather(1, index)
    return picked[:, 0], unusable


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, b: SamplingBatch) -> list[dict[int, Logprob] | None]:
    result: list[dict[int, Logprob] | None] = [None] * b.num_rows
    if b.logprob_rows is None:
        return result
    # Raw model distribution: before penalties, temperature and masking, as vLLM reports by default.
    lp = torch.log_softmax(logits.index_select(0, b.logprob_rows).float(), dim=-1)
    for i, d in zip(b.logprob_host, logprob_dicts(lp, token_ids.index_select(0, b.logprob_rows), b.logprob_counts)):
        result[i] = d
    return result


def logprob_dicts(lp: torch.Tensor, token_ids: torch.Tensor, wants: list[int]) -> list[dict[int, Logprob]]:
    """Per row of log-probabilities lp [rows, vocab]: {token: Logprob} holding token_ids' entry (first, as vLLM
    orders it) and the row's top wants[row]; rank 1 is the most likely. Shared by sampled and prompt logprobs."""
    chosen = token_ids[:, None]
    chosen_lp = lp.gather(1, chosen)
    chosen_rank = (lp > chosen_lp).sum(dim=-1) + 1

    n = max(wants, default=0)
    top_vals = top_ids = top_ranks = None
    if n:
        top_vals, top_ids = lp.topk(n, dim=-1)  # sorted, so everything above a value sits before it
        top_ranks = (top_vals[:, None, :] > top_vals[:, :, None]).sum(dim=-1) + 1

    s_ids, s_lp, s_rank = chosen[:, 0].tolist(), chosen_lp[:, 0].tolist(), chosen_rank.tolist()
    # no top tokens (n == 0) only when every row wants none, so no row reads them
    t_ids: list[list[int]] = top_ids.tolist() if top_ids is not None else []
    t_vals: list[list[float]] = top_vals.tolist() if top_vals is not None else []
    t_ranks: list[list[int]] = top_ranks.tolist() if top_ranks is not None else []
    result = []
    for j, want in enumerate(wants):
        d = {s_ids[j]: Logprob(logprob=s_lp[j], rank=s_rank[j])}
        for c in range(want):
            if t_vals[j][c] == _NEG_INF:
                break  # a constrained row has fewer allowed tokens than asked for: the rest cannot come
            d.setdefault(t_ids[j][c], Logprob(logprob=t_vals[j][c], rank=t_ranks[j][c]))
        result.append(d)
    return result
