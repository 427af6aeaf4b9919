"""Sampler semantics on synthetic logits (no model needed)."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ladle.sampling_params import SamplingParams
from ladle.worker.sampler import Sampler, SamplingMetadata

VOCAB = 64


def make_meta(params: list[SamplingParams], *, outputs: list[list[int]] | None = None,
              prompts: list[list[int]] | None = None, stops: list[frozenset[int]] | None = None,
              seeded: bool = True) -> SamplingMetadata:
    n = len(params)
    gens: list[torch.Generator | None] = [
        torch.Generator().manual_seed(p.seed) if seeded and p.seed is not None else None for p in params
    ]
    return SamplingMetadata(
        params=params,
        generators=gens,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        stop_token_ids=stops or [frozenset() for _ in range(n)],
    )


def rand_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw(logits: torch.Tensor, params: SamplingParams, times: int) -> torch.Tensor:
    """`times` independent draws from one row, done as one batch of identical rows."""
    torch.manual_seed(1234)
    out = Sampler()(logits.expand(times, -1), make_meta([params] * times))
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
        meta = make_meta(meta_params)
        other_logits = rand_logits(batch, seed=100 + batch)
        other_logits[position] = logits
        tokens = []
        for _ in range(20):  # the generator carries over across steps, as in the engine
            tokens.append(Sampler()(other_logits, meta).token_ids[position])
            torch.manual_seed(len(tokens))  # perturb the global RNG that unseeded rows use
        return tokens

    ref = run_seeded(0, 1)
    assert run_seeded(3, 5) == ref
    assert run_seeded(0, 4) == ref
    assert run_seeded(6, 7) == ref


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: identical streams would be a strong signal
    streams = []
    for seed in (1, 2):
        meta = make_meta([SamplingParams(seed=seed)])
        streams.append([Sampler()(logits, meta).token_ids[0] for _ in range(50)])
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
    meta = make_meta([params], outputs=[output], prompts=[prompt or []])
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
    out = Sampler()(logits, make_meta(params, outputs=[[0], [0]]))
    assert out.token_ids == [1, 0]


@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_values_and_ranks(n: int) -> None:
    logits = rand_logits(6, vocab=200, seed=5)
    params = [SamplingParams(temperature=1.5, logprobs=n, repetition_penalty=1.3, top_k=20)] * 5 + [
        SamplingParams(temperature=0.0)]
    meta = make_meta(params, outputs=[[1, 2, 3]] * 6)
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
    out = Sampler()(logits, make_meta([SamplingParams(temperature=0.0, logprobs=3)]))
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
