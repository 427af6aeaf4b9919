"""Scheduler invariants without a model: token budget, chunk cap, order, admission, preemption, rejection."""
import pytest
import torch

from ladle.startup.engine_config import EngineConfig
from ladle.kv_cache.manager import KVCacheManager
from ladle.engine.scheduler import Scheduler
from ladle.request import Request, RequestRejected
from ladle.runner.model_runner import SampledToken
from ladle.sampling_params import SamplingParams


def make_scheduler(budget=64, chunk=None, blocks=100, block_size=4, max_len=256, max_seqs=16):
    cfg = EngineConfig(model="m", tokenizer="m", device=torch.device("cpu"), dtype=torch.float32,
                       max_model_len=max_len, max_num_batched_tokens=budget, max_prefill_length=chunk or budget,
                       max_num_seqs=max_seqs, block_size=block_size, num_kv_blocks=blocks, seed=0)
    # Prompts here share prefixes (1, 2, 3, ...); with caching on, they would wait for each other's blocks
    # (test_prefix_cache.py covers that), and these tests are about budget and block accounting.
    return Scheduler(cfg, KVCacheManager(blocks, block_size, enable_caching=False))


def make_request(rid, prompt_len, max_tokens=4):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_tokens, frozenset())


def run(sched, on_step=None):
    """Drive the scheduler as the core does, sampling token 7; returns the list of step outputs."""
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.scheduled, "no progress"
        steps.append(out)
        if on_step:
            on_step(out)
        advance(sched, out)
        assert len(steps) < 10_000
    return steps


def sample_sevens(out):
    """A step's sampled tokens, as if the model always answered 7."""
    return {s.request.request_id: SampledToken(7, None) for s in out.scheduled if s.samples}


def advance(sched, out):
    """What the core does after a step, by the scheduler's own code: every row that samples gets token 7."""
    return sched.update_from_output(out, sample_sevens(out))


def test_budget_and_chunk_cap_hold_every_step():
    sched = make_scheduler(budget=7, chunk=5)
    reqs = [make_request(f"r{i}", n) for i, n in enumerate([1, 12, 30, 3, 17])]
    for r in reqs:
        sched.add(r)
    steps = run(sched)
    for out in steps:
        assert out.num_tokens <= 7
        for s in out.scheduled:
            if s.request.is_prefilling or s.start_pos < s.request.num_prompt_tokens:
                assert s.num_new_tokens <= 5
    assert all(r.num_output_tokens == 4 for r in reqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_decodes_come_before_partial_prefills_and_new_requests():
    sched = make_scheduler(budget=8)
    a, b = make_request("a", 2, max_tokens=50), make_request("b", 40)
    sched.add(a)
    advance(sched, sched.schedule())  # a prefills whole
    sched.add(b)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]


def test_mid_prefill_chunk_is_not_sampled():
    sched = make_scheduler(budget=16)
    r = make_request("r", 40)
    sched.add(r)
    first = sched.schedule().scheduled[0]
    assert first.num_new_tokens == 16 and not first.samples


def test_admission_needs_the_whole_prompt():
    sched = make_scheduler(budget=4, blocks=10, block_size=4, max_len=40)
    big, small = make_request("big", 30, max_tokens=4), make_request("small", 20, max_tokens=4)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    # big takes 8 of 10 blocks at admission though it prefills only 4 tokens now; small (5 blocks) must wait
    assert [s.request.request_id for s in out.scheduled] == ["big"]
    assert sched.kv.num_free_blocks == 2 and list(sched.waiting) == [small]


def test_rejected_when_it_can_never_fit():
    sched = make_scheduler(blocks=10, block_size=4, max_len=100)
    with pytest.raises(RequestRejected, match="max_model_len=100") as e:
        sched.add(make_request("long", 90, max_tokens=20))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected, match="whole pool has 10"):
        sched.add(make_request("wide", 41, max_tokens=1))
    assert not sched.has_unfinished()


def test_preemption_recomputes_and_keeps_generated_tokens():
    sched = make_scheduler(budget=64, blocks=12, block_size=4, max_len=64)
    reqs = [make_request(f"r{i}", 10, max_tokens=12) for i in range(4)]
    for r in reqs:
        sched.add(r)
    seen = []

    def check(out):
        for rid in out.preempted_ids:
            r = next(x for x in reqs if x.request_id == rid)
            assert r.num_computed_tokens == 0 and r in sched.waiting
            seen.append((rid, r.num_output_tokens))
        used = sum(len(t) for t in sched.kv.tables[0].values())
        assert used + sched.kv.num_free_blocks == sched.kv.num_blocks

    run(sched, check)
    assert seen and sum(r.num_preemptions for r in reqs) == len(seen)
    assert any(n > 0 for _, n in seen)  # a preempted request kept generated tokens and resumed
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_budget_of_one_token():
    sched = make_scheduler(budget=1)
    reqs = [make_request("a", 3, max_tokens=2), make_request("b", 2, max_tokens=2)]
    for r in reqs:
        sched.add(r)
    steps = run(sched)
    assert all(out.num_tokens == 1 for out in steps)
    assert sum(out.num_tokens for out in steps) == 3 + 2 + 2 * 1  # each prompt once, one decode token each
