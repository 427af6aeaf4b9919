"""Async scheduling: a decode step whose successor is certain launches it before reading its own tokens.
Outputs must equal the synchronous engine's token for token, whatever happens in the step's shadow: length
and stop-token finishes, aborts, new arrivals, preemption pressure, prefix hits, seeded sampling, min_tokens
(decided by the position drawn, known before the tokens are read); and steps that need the host (logprobs,
penalties) run synchronously."""
import random

import pytest

from ladle import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int, seed: int, shared: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(500) for _ in range(shared)]
    return [{"prompt_token_ids": prefix + [rng.randrange(500) for _ in range(rng.randrange(3, 30))]}
            for _ in range(n)]


def tokens(llm: LLM, batch: list[dict], params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def pair(tiny_qwen3_dir: str) -> tuple[LLM, LLM]:
    return (LLM(tiny_qwen3_dir, max_num_batched_tokens=64),
            LLM(tiny_qwen3_dir, max_num_batched_tokens=64, async_scheduling=True))


def test_greedy_and_seeded_outputs_equal_the_synchronous_engine(pair: tuple[LLM, LLM]) -> None:
    sync, ahead = pair
    batch = prompts(6, seed=1)
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 9, 17, 24)]
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=40 + i, max_tokens=15, ignore_eos=True)
              for i in range(6)]
    before = ahead.stats.steps_ahead
    for params in (lengths, seeded):
        assert tokens(ahead, batch, params) == tokens(sync, batch, params)
    assert ahead.stats.steps_ahead - before > 10
    assert ahead.config.settings["async_scheduling"].source == "explicit"


def test_a_stop_token_inside_the_launched_step_drops_its_token(pair: tuple[LLM, LLM]) -> None:
    sync, ahead = pair
    batch = prompts(4, seed=2)
    free_run = tokens(sync, batch, GREEDY)
    # Each request stops at a token it generates mid-way, so the step already launched for it is void.
    params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[out[5 + i]]) for i, out in enumerate(free_run)]
    dropped = ahead.stats.tokens_dropped
    want = tokens(sync, batch, params)
    assert tokens(ahead, batch, params) == want and all(len(w) < 24 for w in want)
    assert ahead.stats.tokens_dropped > dropped
    assert ahead.engine.core.kv.num_free_blocks == ahead.engine.core.kv.num_blocks


def test_aborts_and_arrivals_between_steps(tiny_qwen3_dir: str) -> None:
    """Driving the core directly: a request aborted while its next step is in flight ends with "abort" and
    leaks no blocks; one that arrives meanwhile is admitted next and decodes the same tokens."""
    results = []
    for async_on in (False, True):
        core = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, async_scheduling=async_on).engine.core
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        for i, p in enumerate(prompts(3, seed=3)):
            core.add_request(core.make_request(f"a{i}", p["prompt_token_ids"], params))
        got: dict[str, list[int]] = {}
        finish: dict[str, str] = {}
        step = 0
        while core.has_unfinished_requests():
            for out in core.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason:
                    finish[out.request_id] = out.finish_reason
            step += 1
            if step == 6:
                for out in core.abort_requests(["a1"]):
                    finish[out.request_id] = out.finish_reason
                core.add_request(core.make_request("late", prompts(1, seed=4)[0]["prompt_token_ids"], params))
        results.append((got, finish))
        assert core.kv.num_free_blocks == core.kv.num_blocks
        assert core.stats.tokens_dropped == (1 if async_on else 0)  # a1's step in flight at the abort
    (sync_got, sync_finish), (got, finish) = results
    assert finish == sync_finish and finish["a1"] == "abort"
    for rid in ("a0", "a2", "late"):
        assert got[rid] == sync_got[rid]


def test_pool_pressure_and_prefix_hits(tiny_qwen3_dir: str) -> None:
    """Three running at a time (so waiting requests cannot be admitted and steps run ahead) on a pool that
    runs short: the step-ahead finds no free block at some boundaries and the engine preempts as usual."""
    batch = prompts(8, seed=5, shared=33)
    outs = []
    for async_on in (False, True):
        llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, max_num_seqs=3, num_kv_blocks=8,
                  async_scheduling=async_on)
        outs.append(tokens(llm, batch, GREEDY))
        assert llm.stats.num_preemptions > 0 and llm.stats.prefix_cache_hits > 0
        assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
        assert (llm.stats.steps_ahead > 0) == async_on
    assert outs[0] == outs[1]


def test_steps_that_need_the_host_run_synchronously(pair: tuple[LLM, LLM]) -> None:
    sync, ahead = pair
    batch = prompts(3, seed=6)
    host_bound = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
                  SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=0.4)]
    before = ahead.stats.steps_ahead
    got = ahead.generate(batch, host_bound, use_tqdm=False)
    want = sync.generate(batch, host_bound, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].outputs[0].logprobs is not None
    assert ahead.stats.steps_ahead == before


def test_min_tokens_steps_launch_ahead_and_hold_stops_back_alike(pair: tuple[LLM, LLM]) -> None:
    sync, ahead = pair
    batch = prompts(3, seed=8)
    free = sync.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    stop = free[0].outputs[0].token_ids[2]  # the first request would stop at its third token
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=8, stop_token_ids=[stop], ignore_eos=True)
    before = ahead.stats.steps_ahead
    got = ahead.generate(batch, params, use_tqdm=False)
    want = sync.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(want[0].outputs[0].token_ids) >= 8 and stop not in want[0].outputs[0].token_ids[:8]
    assert ahead.stats.steps_ahead > before


def test_out_of_memory_in_a_launched_step_falls_back_to_the_synchronous_path(
        pair: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every third launch (a step's own or a step ahead) runs out of memory: the step runs synchronously
    instead (with the usual OOM retries there), and the tokens do not change."""
    import torch

    sync, ahead = pair
    batch = prompts(4, seed=7)
    runner = ahead.engine.core.model_executor.runner
    real_launch, calls = runner.launch, []

    def flaky_launch(*args, **kwargs):
        calls.append(1)
        if len(calls) % 3 == 0:
            raise torch.OutOfMemoryError("injected")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(runner, "launch", flaky_launch)
    assert tokens(ahead, batch, GREEDY) == tokens(sync, batch, GREEDY)
    assert len(calls) > 6


def test_constrained_requests_never_run_in_a_step_launched_ahead(pair: tuple[LLM, LLM]) -> None:
    """A grammar's bitmask needs the token before it, so constrained rows run synchronously; the unconstrained
    rows beside them still launch ahead once the constrained ones are done."""
    from ladle.sampling_params import StructuredOutputsParams

    sync, ahead = pair
    batch = prompts(6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=4 if i % 3 else 40, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex="[a-z]{1,3}( [a-z]{1,3}){0,2}")
                             if i % 3 else None) for i in range(6)]
    before = ahead.stats.steps_ahead
    assert tokens(ahead, batch, params) == tokens(sync, batch, params)
    assert ahead.stats.steps_ahead > before
