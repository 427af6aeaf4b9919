"""Long prompts never block short ones: the step's prefills share the budget (partial-prefill caps, max-min
fair shares), admission passes over a request the pool cannot take yet (a bounded number of times), and
priority scheduling. Scheduler-level, no model; the engine-level check is in test_long_prompt_fairness.py."""
import pytest
import torch

from ladle.config.engine_args import EngineArgs
from ladle.startup.engine_config import EngineConfig
from ladle.engine.scheduler import fair_shares
from ladle.startup.partial_prefill import PartialPrefillLimits
from ladle.engine.scheduler import Scheduler
from ladle.kv_cache.manager import KVCacheManager
from ladle.request import Request, RequestRejected, RequestStatus
from ladle.sampling_params import SamplingParams
from test_scheduler import advance, run


def make_scheduler(budget=64, limits=(4, 1, 64), blocks=400, block_size=4, max_seqs=16, policy="fcfs",
                   chunk=None) -> Scheduler:
    cfg = EngineConfig(model="m", tokenizer="m", device=torch.device("cpu"), dtype=torch.float32,
                       max_model_len=4096, max_num_batched_tokens=budget, max_prefill_length=chunk or budget,
                       max_num_seqs=max_seqs, block_size=block_size, num_kv_blocks=blocks, seed=0,
                       partial_prefills=PartialPrefillLimits(*limits), scheduling_policy=policy)
    return Scheduler(cfg, KVCacheManager(blocks, block_size, enable_caching=False))


def make_request(rid, prompt_len, max_tokens=2, priority=0, arrival=None):
    params = SamplingParams(max_tokens=max_tokens, priority=priority)
    req = Request(rid, [rid.__hash__() % 97 + i for i in range(prompt_len)], params, max_tokens, frozenset())
    if arrival is not None:
        req.arrival_time = arrival
    return req


def chunks(out):
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


@pytest.mark.parametrize("demands,budget,want", [
    ([16, 1000], 512, [16, 496]), ([1000, 1000], 512, [256, 256]), ([300, 10, 1000], 512, [251, 10, 251]),
    ([5, 5], 512, [5, 5]), ([1000, 1000, 1000], 1, [0, 0, 1]), ([], 64, [])])
def test_fair_shares_meet_small_demands_first_and_leave_nothing_unused(demands, budget, want):
    got = fair_shares(demands, budget)
    assert got == want
    assert sum(got) == min(budget, sum(demands))


def test_a_short_prompt_starts_beside_a_long_prefill_and_takes_only_what_it_needs():
    sched = make_scheduler(budget=64)
    long = make_request("long", 1000)
    sched.add(long)
    out = sched.schedule()
    assert chunks(out) == {"long": 64}
    advance(sched, out)
    sched.add(make_request("short", 5))
    out = sched.schedule()
    assert chunks(out) == {"long": 59, "short": 5}  # admitted at once; the long prefill keeps the rest
    advance(sched, out)
    assert chunks(sched.schedule()) == {"short": 1, "long": 63}  # decodes first, never starved


def test_one_long_prefill_at_a_time_while_short_ones_pass():
    sched = make_scheduler(budget=64, limits=(4, 1, 64))
    for rid, n in (("long1", 300), ("long2", 300), ("short", 10)):
        sched.add(make_request(rid, n))
    out = sched.schedule()
    assert set(chunks(out)) == {"long1", "short"}  # long2 waits for long1, short goes past it
    long_at_once = []
    while sched.has_unfinished():
        advance(sched, out)
        out = sched.schedule()
        long_left = [s for s in out.scheduled if s.is_prefill and sched.limits.is_long(
            s.request.num_tokens - s.start_pos)]
        long_at_once.append(len(long_left))
    assert max(long_at_once) == 1
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_at_most_max_num_partial_prefills_prefill_in_a_step():
    sched = make_scheduler(budget=64, limits=(2, 1, 64))
    for i in range(6):
        sched.add(make_request(f"r{i}", 40))
    steps = run(sched)
    assert max(out.num_prefill_chunks for out in steps) == 2
    assert all(out.num_tokens <= 64 for out in steps)


def test_a_request_the_pool_cannot_take_is_passed_over_a_bounded_number_of_times():
    """Blocks of 4 tokens, 60 in the pool: `big` (200 tokens) cannot start while `holder` holds 30 blocks, so
    small ones behind it start instead, at most max_pass_over times; then nothing passes it, the pool drains
    and it starts."""
    sched = make_scheduler(budget=64, limits=(4, 1, 512), blocks=60, max_seqs=64)
    sched.max_pass_over = 3
    holder = make_request("holder", 100, max_tokens=20)
    sched.add(holder)
    advance(sched, sched.schedule())
    big = make_request("big", 200)
    sched.add(big)
    smalls = [make_request(f"s{i}", 4, max_tokens=1) for i in range(12)]
    for s in smalls:
        sched.add(s)
    passed = []
    while big.status is RequestStatus.WAITING:
        out = sched.schedule()
        if big.status is RequestStatus.WAITING:
            passed += [s.request.request_id for s in out.scheduled if s.request in smalls]
        advance(sched, out)
    assert passed == ["s0", "s1", "s2"] and big.num_passed_over == 0  # reset once admitted
    run(sched)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in [holder, big] + smalls)


def test_priority_orders_admission_and_preempts_the_lowest_priority_first():
    sched = make_scheduler(budget=64, limits=(1, 1, 64), policy="priority")
    for rid, prio, t in (("low", 5, 0.0), ("high", -1, 1.0), ("mid", 0, 2.0), ("mid_late", 0, 3.0)):
        sched.add(make_request(rid, 8, priority=prio, arrival=t))
    order = []
    for out in run(sched):
        order += [s.request.request_id for s in out.scheduled if s.start_pos == 0]
    assert order == ["high", "mid", "mid_late", "low"]
    # Under KV pressure the victim is the lowest priority, not the newest.
    sched = make_scheduler(budget=64, limits=(4, 1, 64), policy="priority", blocks=12, max_seqs=8)
    low, high = make_request("low", 16, max_tokens=20, priority=9, arrival=0.0), make_request(
        "high", 16, max_tokens=20, priority=0, arrival=1.0)
    sched.add(low)
    advance(sched, sched.schedule())
    sched.add(high)
    preempted = [rid for out in run(sched, on_step=lambda out: None) for rid in out.preempted_ids]
    assert preempted and set(preempted) == {"low"}


def test_fcfs_refuses_a_priority_and_bad_settings_are_refused_before_loading(tiny_qwen3_dir):
    with pytest.raises(RequestRejected, match="priority=3 needs priority scheduling"):
        make_scheduler().add(make_request("p", 4, priority=3))
    for kwargs, match in ((dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "exceeds"),
                          (dict(max_num_partial_prefills=0), "positive integer"),
                          (dict(long_prefill_token_threshold=-1), "positive integer"),
                          (dict(scheduling_policy="lifo"), "choose one of fcfs, priority")):
        args, _ = EngineArgs.from_kwargs(model=tiny_qwen3_dir, **kwargs)
        with pytest.raises(ValueError, match=match):
            args.validate()


def test_an_engine_with_priority_scheduling_serves_the_lowest_value_first(tiny_qwen3_dir):
    """LLM.generate(priority=...) reaches the scheduler: one request at a time, the order of first tokens is
    the order of priorities, whatever the order the prompts were given in."""
    from ladle import LLM

    llm = LLM(tiny_qwen3_dir, max_num_seqs=1, scheduling_policy="priority")
    core = llm.engine.core
    firsts = []
    original = core.step

    def step():
        outs = original()
        firsts.extend(o.request_id for o in outs if o.new_token_ids and o.request_id not in firsts)
        return outs

    core.step = step
    prompts = [{"prompt_token_ids": [5 + i] * 8} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, priority=[3, -2, 7, 0])
    assert [o.request_id for o in outs] == sorted(firsts, key=int)  # outputs still in prompt order
    assert [int(r) - int(outs[0].request_id) for r in firsts] == [1, 3, 0, 2]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompts, use_tqdm=False, priority=[1])


def test_every_scheduling_policy_the_flag_accepts_is_a_policy_class_and_no_other():
    from ladle.config.engine_args import SCHEDULING_POLICIES
    from ladle.engine.request_queue import scheduling_policy

    assert [scheduling_policy(name).name for name in SCHEDULING_POLICIES] == list(SCHEDULING_POLICIES)
    with pytest.raises(ValueError, match="scheduling_policy='lifo': choose one of fcfs, priority"):
        scheduling_policy("lifo")
