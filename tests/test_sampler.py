"""Sampler semantics on synthetic logits (no model needed)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from ladle.sampling_params import SamplingParams
from ladle.runner.sampler import Sampler, _draw, _inverse_cdf, _min_p, _sorted_weights
from ladle.runner.sampling_batch import (
    Filters, SamplingBatch, SamplingMetadata, counter_uniforms, sampling_metadata, seed_keys,
)

VOCAB = 64


def make_meta(params: list[SamplingParams], *, outputs: list[list[int]] | None = None,
              prompts: list[list[int]] | None = None, stops: list[frozenset[int]] | None = None,
              positions: list[int] | None = None, vocab: int = VOCAB) -> SamplingMetadata:
    return sampling_metadata(params, vocab, prompts=prompts, outputs=outputs, stops=stops, positions=positions)


def rand_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw(logits: torch.Tensor, params: SamplingParams, times: int) -> torch.Tensor:
    """`times` independent draws from one row, done as one batch of identical rows."""
    torch.manual_seed(1234)
    out = Sampler()(logits.expand(times, -1), make_meta([params] * times, vocab=logits.shape[-1]))
    return torch.tensor(out.token_ids)


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = rand_logits(8)
    before = logits.clone()
    out = Sampler()(logits, make_meta([SamplingParams(temperature=0.0)] * 8))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8
    # Penalties and min_tokens force the slow path; the caller's tensor must still be intact.
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, min_tokens=2)
    Sampler()(logits, make_meta([p] * 8, outputs=[[1, 2]] * 8, prompts=[[3]] * 8, stops=[frozenset({4})] * 8))
    assert torch.equal(logits, before)


def test_top_k_one_equals_greedy() -> None:
    logits = rand_logits(16, seed=1)
    mixed = [SamplingParams(temperature=1.0, top_k=1) if i % 2 else SamplingParams(temperature=0.0)
             for i in range(16)]
    out = Sampler()(logits, make_meta(mixed))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_reproducible_regardless_of_batch() -> None:
    logits = rand_logits(1, seed=2)[0]
    seeded = SamplingParams(temperature=1.0, seed=7)
    other = SamplingParams(temperature=1.0)

    def run_seeded(position: int, batch: int) -> list[int]:
        meta_params = [other] * batch
        meta_params[position] = seeded
        other_logits = rand_logits(batch, seed=100 + batch)
        other_logits[position] = logits
        tokens = []
        for step in range(20):  # one token a step, as in the engine: the drawn position advances
            meta = make_meta(meta_params, positions=[10 + step] * batch)
            tokens.append(Sampler()(other_logits, meta).token_ids[position])
            torch.manual_seed(len(tokens))  # perturb the global RNG that unseeded rows use
        return tokens

    ref = run_seeded(0, 1)
    assert len(set(ref)) > 1  # a stream, not one token again and again
    assert run_seeded(3, 5) == ref
    assert run_seeded(0, 4) == ref
    assert run_seeded(6, 7) == ref


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: identical streams would be a strong signal
    streams = []
    for seed in (1, 2):
        streams.append([Sampler()(logits, make_meta([SamplingParams(seed=seed)], positions=[p])).token_ids[0]
                        for p in range(50)])
    assert streams[0] != streams[1]


@pytest.mark.parametrize("params,allowed_fn", [
    (SamplingParams(top_k=5), lambda p: set(p.topk(5).indices.tolist())),
    (SamplingParams(top_p=0.5), lambda p: _nucleus(p, 0.5)),
    (SamplingParams(min_p=0.2), lambda p: set(torch.nonzero(p >= 0.2 * p.max()).flatten().tolist())),
    (SamplingParams(temperature=0.7, top_k=10, top_p=0.8), None),
])
def test_filters_never_leave_allowed_set(params: SamplingParams,
                                         allowed_fn: Callable[[torch.Tensor], set[int]] | None) -> None:
    logits = rand_logits(1, seed=3)[0] / 2  # flatter, so each filter has real work to do
    if allowed_fn is None:
        probs = torch.softmax(logits / 0.7, -1)
        top10 = probs.topk(10)
        renorm = torch.zeros_like(probs).scatter(0, top10.indices, top10.values / top10.values.sum())
        allowed = _nucleus(renorm, 0.8)
    else:
        allowed = allowed_fn(torch.softmax(logits, -1))
    assert 1 < len(allowed) < VOCAB
    got = set(draw(logits, params, 4000).tolist())
    assert got <= allowed
    assert len(got) >= len(allowed) // 2  # the filter does not collapse to greedy either


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    vals, idx = probs.sort(descending=True)
    keep = (vals.cumsum(0) - vals) < top_p
    return set(idx[keep].tolist())


def test_temperature_sampling_matches_softmax() -> None:
    logits = rand_logits(1, vocab=50, seed=4)[0] / 3
    temp, draws = 0.8, 20000
    got = torch.bincount(draw(logits, SamplingParams(temperature=temp), draws), minlength=50).float()
    expected = torch.softmax(logits / temp, -1) * draws
    chi2 = float(((got - expected) ** 2 / expected).sum())
    assert chi2 < 120  # 49 dof: mean 49, a real mismatch lands far above


def test_min_tokens_blocks_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 10.0  # eos is the favourite
    logits[0, 9] = 9.0  # a user stop token is next
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    stops = [frozenset({5, 9})]
    early = Sampler()(logits, make_meta([params], outputs=[[1, 2]], stops=stops))
    assert early.token_ids[0] not in (5, 9)
    done = Sampler()(logits, make_meta([params], outputs=[[1, 2, 3]], stops=stops))
    assert done.token_ids == [5]
    # Blocked tokens are never drawn by random sampling either.
    rand = SamplingParams(temperature=1.0, min_tokens=1)
    meta = make_meta([rand] * 500, stops=[frozenset({5})] * 500)
    assert 5 not in Sampler()(logits.expand(500, -1), meta).token_ids


def _greedy(logits: list[float], params: SamplingParams, output: list[int], prompt: list[int] | None = None) -> int:
    meta = make_meta([params], outputs=[output], prompts=[prompt or []], vocab=len(logits))
    return Sampler()(torch.tensor([logits]), meta).token_ids[0]


def test_presence_penalty() -> None:
    base = [2.0, 1.5, 0.0]
    # Token 0 was seen 3 times; presence ignores the count: 2.0 - 0.6 = 1.4 < 1.5.
    assert _greedy(base, SamplingParams(temperature=0.0, presence_penalty=0.6), [0, 0, 0]) == 1
    assert _greedy(base, SamplingParams(temperature=0.0, presence_penalty=0.4), [0, 0, 0]) == 0
    # Prompt tokens do not count for presence.
    assert _greedy(base, SamplingParams(temperature=0.0, presence_penalty=2.0), [], prompt=[0]) == 0


def test_frequency_penalty() -> None:
    base = [2.0, 1.5, 0.0]
    # 2.0 - 0.2 * 3 = 1.4 < 1.5 flips; 2.0 - 0.2 * 2 = 1.6 does not.
    assert _greedy(base, SamplingParams(temperature=0.0, frequency_penalty=0.2), [0, 0, 0]) == 1
    assert _greedy(base, SamplingParams(temperature=0.0, frequency_penalty=0.2), [0, 0]) == 0
    # Negative penalty encourages repeats.
    assert _greedy([1.0, 1.5], SamplingParams(temperature=0.0, frequency_penalty=-0.3), [0, 0]) == 0


def test_repetition_penalty() -> None:
    p2 = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # Positive logit divided: 3.0 / 2 = 1.5 < 2.0; seen via the prompt only.
    assert _greedy([3.0, 2.0], p2, [], prompt=[0]) == 1
    assert _greedy([3.0, 1.4], p2, [], prompt=[0]) == 0
    # Negative logit multiplied: -1.0 * 2 = -2.0 < -1.5 (unpenalized would win).
    assert _greedy([-1.0, -1.5], p2, [0]) == 1
    # A penalty < 1 rewards seen tokens: -2.0 * 0.5 = -1.0 > -1.5.
    assert _greedy([-2.0, -1.5], SamplingParams(temperature=0.0, repetition_penalty=0.5), [0]) == 0


def test_penalties_only_touch_their_rows() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, make_meta(params, outputs=[[0], [0]], vocab=3))
    assert out.token_ids == [1, 0]


@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_values_and_ranks(n: int) -> None:
    logits = rand_logits(6, vocab=200, seed=5)
    params = [SamplingParams(temperature=1.5, logprobs=n, repetition_penalty=1.3, top_k=20)] * 5 + [
        SamplingParams(temperature=0.0)]
    meta = make_meta(params, outputs=[[1, 2, 3]] * 6, vocab=200)
    torch.manual_seed(0)
    out = Sampler()(logits, meta)
    ref = torch.log_softmax(logits.float(), -1)
    assert out.logprobs[5] is None
    for row in range(5):
        d = out.logprobs[row]
        tok = out.token_ids[row]
        top = ref[row].topk(n).indices.tolist() if n else []
        assert tok in d
        assert set(d) == set(top) | {tok}
        assert len(d) == n + (tok not in top)
        for t, lp in d.items():
            assert abs(lp.logprob - ref[row, t].item()) < 1e-6  # raw logits: penalties/temperature ignored
            assert lp.rank == 1 + int((ref[row] > ref[row, t]).sum())
        for i, t in enumerate(top):
            assert d[t].rank == i + 1  # random logits: no ties


def test_logprobs_rank_ties_and_greedy_rank_one() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5]])
    out = Sampler()(logits, make_meta([SamplingParams(temperature=0.0, logprobs=3)], vocab=4))
    d = out.logprobs[0]
    assert out.token_ids == [1]  # first max, like torch.argmax / HF greedy
    assert {t: lp.rank for t, lp in d.items()} == {1: 1, 2: 1, 0: 3}


def test_bf16_logits_and_mixed_batch() -> None:
    logits = rand_logits(4, seed=6).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=3, top_p=0.9),
              SamplingParams(min_p=0.1), SamplingParams(temperature=0.0, logprobs=2)]
    out = Sampler()(logits, make_meta(params))
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[3] == int(logits[3].argmax())
    assert out.logprobs[3] is not None and len(out.logprobs[3]) == 2
    assert all(0 <= t < VOCAB for t in out.token_ids)


def _full_sort_draw(x: torch.Tensor, b: SamplingBatch, u: torch.Tensor) -> torch.Tensor:
    """A filtered row's draw from the whole vocabulary sorted (the CUDA path), an unfiltered one's from the
    softmax in vocabulary order."""
    vals, ids = x.sort(dim=-1, descending=True, stable=True)
    f = Filters.of(b.params, b.vocab, x.device)
    sorted_draw = _inverse_cdf(_min_p(_sorted_weights(vals, f, None), f.min_p), u, ids)
    plain_draw = _inverse_cdf(_min_p(x.softmax(-1), f.min_p), u, None)
    filtered = [p.top_k > 0 or p.top_p < 1 for p in b.params]
    return torch.where(torch.tensor(filtered), sorted_draw[0], plain_draw[0])


@pytest.mark.parametrize("params", [
    [SamplingParams(top_k=5)] * 6,
    [SamplingParams(top_k=300)] * 6,  # more than the default candidates: top-k sets their number
    [SamplingParams(top_p=0.5)] * 6,
    [SamplingParams(top_p=0.97)] * 6,  # a flat row: 256 candidates hold less, so the full sort runs
    [SamplingParams(top_k=20, top_p=0.8, min_p=0.05), SamplingParams(), SamplingParams(top_p=0.97),
     SamplingParams(min_p=0.2), SamplingParams(top_k=3), SamplingParams(top_p=0.3, top_k=600)],
])
def test_cpu_candidates_draw_what_the_full_sort_draws(params: list[SamplingParams]) -> None:
    vocab = 2000
    x = rand_logits(len(params), vocab=vocab, seed=9) / 6  # flat enough that 256 candidates are not all
    batch = make_meta(params, vocab=vocab).batch
    assert batch.split.candidates is not None  # the candidates path, not the full sort
    if any(p.top_p == 0.97 for p in params):
        assert float(x.softmax(-1).topk(256).values.sum(-1).max()) < 0.97  # the fallback is taken
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        u = torch.rand(len(params), dtype=torch.float64, generator=g)
        tokens, unusable = _draw(x, batch, u)
        assert tokens.tolist() == _full_sort_draw(x, batch, u).tolist() and not unusable.any()


def test_candidates_order_ties_as_the_full_sort_does() -> None:
    """bf16-like logits tie often; topk orders ties arbitrarily, the full sort by token id: the candidates
    are put in the full sort's order, and a tie across their edge sends the row to the full sort."""
    vocab = 2000
    x = (rand_logits(4, vocab=vocab, seed=10) * 2).round() / 2  # a handful of distinct values: ties everywhere
    params = [SamplingParams(top_p=0.3), SamplingParams(top_k=40), SamplingParams(top_k=300, top_p=0.5),
              SamplingParams(top_p=0.9, min_p=0.05)]
    batch = make_meta(params, vocab=vocab).batch
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        u = torch.rand(4, dtype=torch.float64, generator=g)
        assert _draw(x, batch, u)[0].tolist() == _full_sort_draw(x, batch, u).tolist()


def test_a_seeded_row_draws_alike_beside_filtered_rows() -> None:
    """Whether other rows use top-k / top-p changes nothing for a seeded row without them."""
    logits = rand_logits(3, seed=11)
    seeded = SamplingParams(temperature=1.0, seed=4)
    for others in ([SamplingParams(temperature=1.0)] * 2, [SamplingParams(top_p=0.5), SamplingParams(top_k=3)]):
        tokens = [Sampler()(logits, make_meta([others[0], seeded, others[1]], positions=[p] * 3)).token_ids[1]
                  for p in range(30)]
        if others[0].top_p == 1.0:
            want = tokens
    assert tokens == want and len(set(want)) > 1


def test_counter_uniforms_are_uniform_and_pure() -> None:
    seeds = np.repeat(np.arange(200, dtype=np.uint64), 500)
    positions = np.tile(np.arange(500, dtype=np.int64), 200)
    u = counter_uniforms(seed_keys(seeds), positions)
    assert ((0 <= u) & (u < 1)).all() and np.array_equal(u, counter_uniforms(seed_keys(seeds), positions))
    counts = np.bincount((u * 100).astype(int), minlength=100)
    expected = len(u) / 100
    assert ((counts - expected) ** 2 / expected).sum() < 160  # 99 dof: mean 99
    # Neighbouring seeds and positions are not correlated.
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02
    assert abs(np.corrcoef(u[:-500], u[500:])[0, 1]) < 0.02


def test_a_seed_and_its_uint64_twin_draw_alike() -> None:
    logits = torch.zeros(2, VOCAB)
    meta = make_meta([SamplingParams(seed=-1), SamplingParams(seed=2**64 - 1)], positions=[5, 5])
    a, b = Sampler()(logits, meta).token_ids
    assert a == b
