"""Fault isolation: whatever one request causes inside a step ends that request only, and the others' outputs
are exactly what they would have been without it. Two steps in a row that fail for everyone end the engine."""
from __future__ import annotations

import random

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.engine.core import EngineStepError
from ladle.frontend.output_processor import OutputProcessor
from ladle.engine.core_output import EngineCoreOutput
from ladle.sampling_params import InvalidSamplingParam
from ladle.runner.sampler import FAILED, Sampler
from ladle.runner.sampling_batch import SamplingMetadata, sampling_metadata

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompt(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(500) for _ in range(n)]}


def hostile(**fields) -> SamplingParams:
    """Params changed after validation (as a buggy caller or a validation gap would deliver them): the
    engine must contain them, not trust them."""
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def generate_tampered(llm: LLM, batch: list[dict], params: list[SamplingParams], bad: dict[int, dict]) -> list:
    """llm.generate, except that the core requests of the prompts in `bad` get those fields changed after
    they were made (and validated)."""
    ids, tampered = [], []
    for i, (p, sp) in enumerate(zip(batch, params)):
        rid = f"tampered-{random.random()}"
        reqs = llm.engine.make_requests(rid, p["prompt_token_ids"], sp)
        tampered += [(req, bad[i]) for req in reqs if i in bad]
        llm.engine.add_request(rid, None, p["prompt_token_ids"], sp, reqs)
        ids.append(rid)
    for req, fields in tampered:
        for k, v in fields.items():
            setattr(req.sampling_params, k, v)
    return llm._run(ids, use_tqdm=False)


def generate_poisoned(llm: LLM, batch: list[dict], params: list[SamplingParams], row: int, after_steps: int,
                      rows: int) -> list:
    """llm.generate, except that once `after_steps` steps have run, logits row `row` of every step sampling
    `rows` rows is NaN (a model fault that hits one request mid-stream)."""
    model = llm.engine.core.model_executor.runner.model
    steps = [0]
    clean = model.compute_logits

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        logits = clean(hidden)
        if steps[0] >= after_steps and logits.shape[0] == rows:
            logits[row] = float("nan")
        steps[0] += 1
        return logits

    model.compute_logits = poisoned
    try:
        return llm.generate(batch, params, use_tqdm=False)
    finally:
        del model.compute_logits


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir: str) -> LLM:
    return LLM(tiny_qwen3_dir, max_num_batched_tokens=128, num_kv_blocks=128)


def _meta(params: list[SamplingParams], vocab: int) -> SamplingMetadata:
    rows = len(params)
    return sampling_metadata(params, vocab, prompts=[[1, 2]] * rows, outputs=[[3]] * rows,
                             stops=[frozenset([vocab - 1])] * rows)


def test_the_sampler_marks_unusable_rows_failed_and_samples_the_rest_unchanged():
    torch.manual_seed(0)
    vocab = 32
    logits = torch.randn(5, vocab)
    good = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1)]
    bad = [hostile(top_p=0.0), SamplingParams(temperature=0), SamplingParams(temperature=0.7)]
    batch = logits.clone()
    batch[3, 4] = float("nan")  # a NaN in a greedy row
    batch[4] = float("-inf")  # every token masked in a sampled row
    params = [good[0], good[1], bad[0], bad[1], bad[2]]
    out = Sampler()(batch, _meta(params, vocab))
    assert out.token_ids[2:] == [FAILED] * 3 and out.logprobs[2:] == [None] * 3
    alone = Sampler()(logits[:2], _meta(good, vocab))
    assert out.token_ids[:2] == alone.token_ids and FAILED not in alone.token_ids


def test_extreme_but_valid_values_still_sample():
    """The smallest float32 repetition penalty and the largest temperature-scaled logits saturate at the
    largest float instead of overflowing to inf (whose softmax is NaN)."""
    logits = torch.randn(3, 16) * 1e3
    params = [SamplingParams(temperature=1.0, repetition_penalty=2.0**-149, seed=1),
              SamplingParams(temperature=1e-5, seed=2), SamplingParams(temperature=0, repetition_penalty=2.0**-149)]
    meta = sampling_metadata(params, 16, prompts=[[0, 1, 2]] * 3, outputs=[[3]] * 3)
    out = Sampler()(logits, meta)
    assert FAILED not in out.token_ids
    boosted = [t for t in range(4) if logits[2, t] > 0]
    assert not boosted or out.token_ids[2] in boosted  # a penalty below 1 boosts the tokens already seen


def test_a_row_that_cannot_be_sampled_ends_only_its_request(llm: LLM):
    batch = [prompt(20, i) for i in range(4)]
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    params = [GREEDY, seeded, GREEDY, seeded]
    want = llm.generate(batch, params, use_tqdm=False)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    got = generate_tampered(llm, batch + [prompt(20, 9)], params + [sampled], {4: {"top_p": 0.0}})
    assert [o.outputs[0].token_ids for o in got[:4]] == [o.outputs[0].token_ids for o in want]
    assert got[4].outputs[0].finish_reason == "error" and "could not be sampled" in got[4].error
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks


def test_an_exception_for_one_request_is_isolated_by_bisection(llm: LLM):
    batch = [prompt(30, 20 + i) for i in range(6)]
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)
    params = [GREEDY, seeded] * 3
    want = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    doomed = prompt(25, 99)["prompt_token_ids"]
    calls = {"n": 0}

    def fail_with_doomed(sched):
        calls["n"] += 1
        if any(s.request.prompt_token_ids == doomed and s.request.num_output_tokens >= 2 for s in sched.scheduled):
            raise RuntimeError("injected: a kernel that chokes on this request")

    core = llm.engine.core
    before = core.stats.isolation_retries
    core.before_execute = fail_with_doomed
    try:
        got = llm.generate(batch[:3] + [{"prompt_token_ids": doomed}] + batch[3:], params[:3] + [GREEDY] + params[3:],
                           use_tqdm=False)
    finally:
        core.before_execute = None
    assert [o.outputs[0].token_ids for o in got[:3] + got[4:]] == want
    failed = got[3]
    assert failed.outputs[0].finish_reason == "error" and len(failed.outputs[0].token_ids) == 2
    assert "RuntimeError" in failed.error and "injected" not in failed.error  # no exception text for clients
    assert core.stats.isolation_retries > before
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_two_steps_in_a_row_that_fail_for_everyone_end_the_engine(tiny_qwen3_dir: str):
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=128, num_kv_blocks=64, max_num_seqs=1)

    def broken(sched):
        raise RuntimeError("injected: the device is gone")

    # One failing step alone is survivable: the request ends, the next one runs.
    llm.engine.core.before_execute = broken
    out = llm.generate([prompt(10, 1)], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "error"
    llm.engine.core.before_execute = None
    assert llm.generate([prompt(10, 1)], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    # Two in a row (max_num_seqs=1: each step holds one request, and each fails) are not.
    llm.engine.core.before_execute = broken
    with pytest.raises(EngineStepError, match="2 steps in a row failed"):
        llm.generate([prompt(10, 2), prompt(10, 3)], GREEDY, use_tqdm=False)


def test_sampling_params_reject_values_that_break_float32():
    for field, value in [("repetition_penalty", 5e-324), ("top_p", 1e-46), ("temperature", float("inf")),
                         ("temperature", float("nan")), ("repetition_penalty", float("nan")),
                         ("min_p", float("nan")), ("repetition_penalty", 1e39), ("temperature", 1e39),
                         ("seed", 2**64), ("stop_token_ids", [-1])]:
        with pytest.raises(InvalidSamplingParam) as e:
            SamplingParams(**{field: value})
        assert e.value.field == field
    seeded = SamplingParams(seed=2**64 - 1, n=3)
    assert [seeded.for_child(i).seed for i in range(3)] == [2**64 - 1, 0, 1]


class _ChokingTokenizer:
    """Decodes like the real one, except that token 13 makes it raise (a tokenizer bug, say)."""

    def __init__(self, real) -> None:
        self.real = real

    def decode(self, ids, **kw):
        if 13 in ids:
            raise ValueError("injected decode failure")
        return self.real.decode(ids, **kw)


def test_a_detokenizer_error_ends_only_its_request(tokenizer):
    proc = OutputProcessor(_ChokingTokenizer(tokenizer))
    params = SamplingParams(max_tokens=4)
    proc.add("a", None, [1, 2, 3], params, ["a"])
    proc.add("b", None, [1, 2, 3], params, ["b"])
    outs, to_abort = proc.process([EngineCoreOutput("a", [13]), EngineCoreOutput("b", [14])])
    by_id = {o.request_id: o for o in outs}
    assert to_abort == ["a"] and by_id["a"].finished and by_id["a"].outputs[0].finish_reason == "error"
    assert "detokenizing" in by_id["a"].error and not by_id["b"].finished
    outs, _ = proc.process([EngineCoreOutput("b", [15], finish_reason="length")])
    assert outs[0].outputs[0].text == tokenizer.decode([14, 15]) and not proc.has_unfinished()


def test_a_failed_row_in_a_step_launched_ahead_ends_only_its_request(tiny_qwen3_dir: str):
    """Async scheduling: the failed row's token is already the input of the step launched ahead; that
    step must run (not index out of the vocabulary) and the others' tokens must not change."""
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=128, num_kv_blocks=128, async_scheduling=True)
    batch = [prompt(12, 40 + i) for i in range(3)]
    params = [SamplingParams(temperature=0.8, seed=21 + i, max_tokens=16, ignore_eos=True) for i in range(3)]
    want = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    dropped = llm.stats.tokens_dropped
    got = generate_poisoned(llm, batch + [prompt(12, 50)], params + [params[0]], row=3, after_steps=5, rows=4)
    assert [o.outputs[0].token_ids for o in got[:3]] == want
    assert got[3].outputs[0].finish_reason == "error" and 3 <= len(got[3].outputs[0].token_ids) <= 6
    assert llm.stats.tokens_dropped > dropped  # the failed request's token in the step launched ahead
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
