"""Speculative decoding (n-gram drafts verified in the normal step): the tokens are those without drafts, for
every sampling mode, under chunked prefill, preemption, prefix hits and aborts; HF's greedy tokens too."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.engine.speculation.ngram_proposer import NgramProposer, propose

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
SPEC_LOGPROB_ATOL = 1e-5  # README, "Speculative decoding": fp32 logprobs with drafts, against the plain run's


def spec(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2, **extra}


def drafting(llm: LLM) -> LLM:
    """llm drafting every proposal: its gate prices drafts by measured step times, so which rows draft would
    depend on the machine's load, and these tests check what verification makes of drafts (the gate has tests
    of its own, in test_spec_gate.py)."""
    speculator = llm.engine.core.scheduler.speculator
    speculator.arms.drafts_now = lambda rows: True
    speculator.gate.allows = lambda request_id, k, rows: k
    return llm


@pytest.fixture(scope="module")
def plain(tiny_qwen3_dir):
    return LLM(tiny_qwen3_dir, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def copy_prompts(plain) -> list[list[int]]:
    """Prompts an n-gram lookup drafts well on: a head, the model's own greedy continuation of it, a few other
    tokens and the head again, so the continuation is proposed where the model may repeat it."""
    rng = random.Random(1)
    heads = [[rng.randrange(500) for _ in range(24)] for _ in range(5)]
    conts = ladle_tokens(plain, heads, GREEDY)
    return [h + c + [rng.randrange(500) for _ in range(6)] + h for h, c in zip(heads, conts)]


@pytest.fixture(scope="module")
def plain_greedy(plain, copy_prompts) -> list[list[int]]:
    return ladle_tokens(plain, copy_prompts, GREEDY)


def test_propose_takes_the_longest_suffix_at_its_earliest_occurrence():
    t = np.array([5, 1, 2, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert propose(t, 1, 3, 2) == (7, 8)  # "1 2 3" occurs at 4..6
    assert propose(t, 1, 2, 3) == (7, 8, 1)  # at most 2-grams: "2 3" at 5..6
    assert propose(t, 3, 3, 9) == (7, 8, 1, 2, 3)  # as many as follow
    assert propose(np.array([1, 2, 7, 1, 2, 8, 1, 2]), 2, 2, 1) == (7,)  # the earliest occurrence, as vLLM's
    assert propose(np.array([4, 5, 6]), 1, 3, 2) == ()  # nothing occurs earlier
    assert propose(t, 1, 3, 0) == ()
    p = NgramProposer(2, 3)
    tokens = [1, 2, 3, 4, 1, 2]
    assert p.propose("r", tokens, 2) == (3, 4)
    tokens += [3, 4, 5]
    assert p.propose("r", tokens, 2) == ()  # "4 5" and "3 4 5" never occurred before
    assert p.propose("r", [9, 9, 9], 2) == (9,)  # a request recomputed with fewer tokens starts over


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_the_plain_run_and_hf(k, tiny_qwen3_dir, hf_qwen3, copy_prompts, plain_greedy):
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, max_prefill_length=19, speculative_config=spec(k)))
    assert ladle_tokens(llm, copy_prompts, GREEDY) == plain_greedy
    s = llm.stats
    assert s.spec_decode_num_accepted_tokens > 0 and s.spec_decode_num_draft_tokens > s.spec_decode_num_accepted_tokens
    assert s.max_step_tokens <= 64
    if k == 3:
        assert plain_greedy == [hf_greedy(hf_qwen3, p, 32) for p in copy_prompts]


def test_preemption_and_prefix_hits_keep_the_tokens(tiny_qwen3_dir, copy_prompts, plain_greedy):
    # 86 tokens + 32 = 8 blocks a request: 14 blocks admit two, which then outgrow them (preempting the newer).
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=14, speculative_config=spec(3)))
    assert ladle_tokens(llm, copy_prompts, GREEDY) == plain_greedy
    assert llm.stats.num_preemptions > 0 and llm.engine.core.kv.num_free_blocks == 14
    roomy = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, speculative_config=spec(3)))
    assert ladle_tokens(roomy, copy_prompts, GREEDY) == plain_greedy
    assert ladle_tokens(roomy, copy_prompts, GREEDY) == plain_greedy  # the second time from the prefix cache
    assert roomy.stats.prefix_cache_hits > 0 and roomy.stats.spec_decode_num_accepted_tokens > 0


def finish_with_abort(llm: LLM, prompts: list[list[int]], params: SamplingParams, at_step: int,
                      victim: str) -> dict[str, list[int]]:
    """Run the prompts (request ids "0", "1", ...) to the end, aborting `victim` after at_step steps: the tokens
    of each request that finished."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, p, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        steps += 1
        if steps == at_step:
            engine.abort_request([victim])
    return done


def test_an_abort_mid_decode_leaves_the_others_as_they_were(tiny_qwen3_dir, copy_prompts, plain_greedy):
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, speculative_config=spec(5)))
    engine = llm.engine
    done = finish_with_abort(llm, copy_prompts, GREEDY, 8, "2")
    assert "2" not in done and llm.stats.spec_decode_num_accepted_tokens > 0
    assert [done[str(i)] for i in (0, 1, 3, 4)] == [plain_greedy[i] for i in (0, 1, 3, 4)]
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_seeded_rows_draw_the_same_tokens_with_drafts(plain, tiny_qwen3_dir, copy_prompts):
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, speculative_config=spec(3)))
    for params in (SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True),
                   SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=9, max_tokens=32,
                                  ignore_eos=True)):
        assert ladle_tokens(llm, copy_prompts, params) == ladle_tokens(plain, copy_prompts, params)
    assert llm.stats.spec_decode_num_accepted_tokens > 0


def _chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity: the p-value that a and b come from one distribution."""
    keys = sorted(set(a) | set(b))
    table = torch.tensor([[a[k] for k in keys], [b[k] for k in keys]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = len(keys) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def test_unseeded_random_rows_sample_the_same_distribution(plain, tiny_qwen3_dir, copy_prompts):
    """Many unseeded samples of the first three tokens after a copy prompt (a few candidates each, top_k=3):
    their joint distribution with drafts is the plain one's (and the test can tell two that differ)."""
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=512, speculative_config=spec(3)))
    prompt = {"prompt_token_ids": copy_prompts[0]}
    params = SamplingParams(n=600, temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)

    def sample(engine: LLM, p: SamplingParams = params) -> Counter:
        return Counter(tuple(c.token_ids) for c in engine.generate([prompt], p, use_tqdm=False)[0].outputs)

    with_drafts, without = sample(llm), sample(plain)
    assert llm.stats.spec_decode_num_accepted_tokens > 50
    assert _chi_square_p(with_drafts, without) > 1e-3
    hotter = sample(plain, SamplingParams(n=600, temperature=3.0, top_k=3, max_tokens=3, ignore_eos=True))
    assert _chi_square_p(hotter, without) < 1e-3


def test_logprobs_are_the_target_models(plain, tiny_qwen3_dir, copy_prompts):
    """The bound the README states: a row with drafts runs as a (k+1)-row chunk, whose sums round otherwise than
    one-row decodes' (at most 4e-6 here on AMD EPYC AVX2, about as far as a different batch moves the plain
    run's); a logprob taken from the wrong position or distribution is off by far more."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, speculative_config=spec(3)))
    got = llm.generate([{"prompt_token_ids": p} for p in copy_prompts], params, use_tqdm=False)
    want = plain.generate([{"prompt_token_ids": p} for p in copy_prompts], params, use_tqdm=False)
    assert llm.stats.spec_decode_num_accepted_tokens > 0
    worst = 0.0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert list(lg) == list(lw) and all(lg[t].rank == lw[t].rank for t in lg)
            worst = max(worst, *(abs(lg[t].logprob - lw[t].logprob) for t in lg))
    print(f"\nlargest logprob difference with drafts: {worst:.2g}")
    assert worst <= SPEC_LOGPROB_ATOL


def test_stops_hold_at_every_accepted_token(plain, tiny_qwen3_dir, copy_prompts, plain_greedy):
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, speculative_config=spec(5)))
    for i, (prompt, full) in enumerate(zip(copy_prompts, plain_greedy)):
        stop = full[7 + i]
        for params in (SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop]),
                       SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop],
                                      min_tokens=full.index(stop) + 1),
                       SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True)):
            want = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
            got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.finish_reason, got.stop_reason) == (want.token_ids, want.finish_reason,
                                                                          want.stop_reason)
    assert llm.stats.spec_decode_num_accepted_tokens > 0


def test_penalties_count_the_drafts_before_each_position(plain, tiny_qwen3_dir, copy_prompts):
    """A penalized row's position j sees the drafts before it as output (as the plain run would have them): the
    tokens equal the plain run's for each kind of penalty, greedy and seeded."""
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, speculative_config=spec(3)))
    prompts = [{"prompt_token_ids": p} for p in copy_prompts]
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.4), dict(presence_penalty=0.6), {}]
    for extra in (dict(temperature=0), dict(temperature=0.8, seed=11)):
        params = [SamplingParams(max_tokens=32, ignore_eos=True, **extra, **kinds[i % len(kinds)])
                  for i in range(len(copy_prompts))]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        assert got == want
    assert llm.stats.spec_decode_num_accepted_tokens > 0


def test_count_drafts_adds_each_positions_earlier_drafts():
    from ladle.runner.payload import ChunkSpec
    from ladle.runner.spec_verify import count_drafts

    specs = [ChunkSpec("a", 10, 4, True, draft_token_ids=(5, 5, 7)), ChunkSpec("b", 3, 1, True)]
    counts = torch.zeros(5, 8)
    counts[4, 5] = 1.0  # b's own output so far
    count_drafts(counts, [0, 1, 2, 3, 4], specs)  # every sampling row penalized: a's four, then b's
    want = torch.zeros(5, 8)
    want[1, 5], want[2, 5], want[3, 5], want[3, 7], want[4, 5] = 1, 2, 2, 1, 1
    assert torch.equal(counts, want)
    counts = torch.zeros(2, 8)
    count_drafts(counts, [2, 4], specs)  # only a's third row and b penalized: rows of counts follow them
    assert counts[0, 5] == 2 and counts.sum() == 2


def test_settings_are_read_shown_or_refused(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    row = llm.engine.core.config.settings["speculative_config"]
    assert (row.value, row.source) == ("ngram, k=2, n-grams of 5-5 tokens", "explicit")
    assert LLM(tiny_qwen3_dir).engine.core.config.settings["speculative_config"].value == "off"
    for bad, said in (({"method": "ngram"}, "num_speculative_tokens is required"),
                      ({"method": "eagle", "num_speculative_tokens": 1}, "'eagle' is not implemented"),
                      ({"method": "ngram", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 1},
                       r"does not read \['draft_tensor_parallel_size'\]"),
                      ({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 4,
                        "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
                      ({"method": "ngram", "num_speculative_tokens": 0}, "must be a positive integer"),
                      ("{not json", "is not JSON")):
        with pytest.raises(ValueError, match=said):
            LLM(tiny_qwen3_dir, speculative_config=bad)


def test_disable_by_batch_size_turns_drafts_off_above_it(tiny_qwen3_dir, copy_prompts, plain_greedy):
    # A budget that prefills all five at once, so five run until they all finish together.
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=512, speculative_config=spec(3, disable_by_batch_size=1)))
    assert ladle_tokens(llm, copy_prompts, GREEDY) == plain_greedy
    drafts = llm.stats.spec_decode_num_drafts
    assert ladle_tokens(llm, copy_prompts[:1], GREEDY) == plain_greedy[:1]
    assert drafts == 0 and llm.stats.spec_decode_num_drafts > 0  # 5 running: none; 1 running: drafts


def test_a_request_opts_out_or_caps_its_drafts(tiny_qwen3_dir, copy_prompts, plain_greedy):
    """SamplingParams.num_speculative_tokens: 0 drafts nothing for that request, 1 at most one a step; the
    tokens are the plain run's either way. A negative value is refused."""
    from dataclasses import replace

    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, speculative_config=spec(3)))
    stats = llm.stats
    for cap, most in ((0, 0), (1, 1), (None, 3)):
        before = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens)
        params = replace(GREEDY, num_speculative_tokens=cap)
        assert ladle_tokens(llm, copy_prompts[:2], params) == plain_greedy[:2]
        rows, drafted = stats.spec_decode_num_drafts - before[0], stats.spec_decode_num_draft_tokens - before[1]
        assert drafted <= most * rows and (drafted > 0) == (most > 0)
        if cap is None:
            assert drafted > rows  # uncapped, some step drafted more than one
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 0"):
        SamplingParams(num_speculative_tokens=-1)


@pytest.mark.slow
def test_tensor_parallel_2_verifies_drafts_on_every_rank(tiny_qwen3_dir, copy_prompts, plain_greedy):
    """Rank 1 builds the same chunks from the drafts in the step's plain specs, so the tokens stay the plain
    run's."""
    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, tensor_parallel_size=2, speculative_config=spec(3)))
    try:
        assert ladle_tokens(llm, copy_prompts, GREEDY) == plain_greedy
        assert llm.stats.spec_decode_num_accepted_tokens > 0
    finally:
        llm.shutdown()


def test_metrics_count_drafts_as_vllm_names_them():
    from ladle.engine.core_output import EngineSnapshot
    from ladle.entrypoints.openai.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.on_snapshot(1, EngineSnapshot(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=9,
                                          spec_decode_num_accepted_tokens=7))
    text = metrics.render().decode()
    for name, value in (("drafts", 3), ("draft_tokens", 9), ("accepted_tokens", 7)):
        assert f'ladle:spec_decode_num_{name}_total{{model_name="m"}} {value}.0' in text

