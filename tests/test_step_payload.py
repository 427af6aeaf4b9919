"""The runner lives on plain payloads: each step's StateUpdate and chunk specs survive a pickle round trip
(as they would on their way to a worker in another process) and the tokens do not change, with seeded
sampling, preemption (requests coming back whole) and prefix-cache hits in the mix."""
from __future__ import annotations

import dataclasses
import pickle
import random
from typing import Any

import pytest

from ladle import LLM, SamplingParams
from ladle.runner.payload import StateUpdate

_LEAVES = (str, int, float, bool, type(None))


def assert_plain(x: Any, path: str = "payload", live: frozenset[int] = frozenset()) -> None:
    """Every element, however deep, is a number, a string, None, a container of them, or a dataclass of
    them: no Request, no tensor, and none of the objects in `live` (ids of the KV manager's block tables,
    which it keeps changing after the payload was sent)."""
    if isinstance(x, _LEAVES):
        return
    assert id(x) not in live, f"{path} is the KV manager's own table, not a copy"
    if isinstance(x, (list, tuple, frozenset, set)):
        for i, item in enumerate(x):
            assert_plain(item, f"{path}[{i}]", live)
    elif isinstance(x, dict):
        for k, v in x.items():
            assert_plain(k, f"{path} key", live)
            assert_plain(v, f"{path}[{k!r}]", live)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        assert type(x).__module__.startswith(("ladle.runner.payload", "ladle.sampling_params")), (path, type(x))
        for f in dataclasses.fields(x):
            assert_plain(getattr(x, f.name), f"{path}.{f.name}", live)
    else:
        raise AssertionError(f"{path} is a {type(x).__name__}, not plain data")


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(500) for _ in range(20)]
    return [{"prompt_token_ids": shared + [rng.randrange(500) for _ in range(rng.randrange(5, 30))]} for _ in range(n)]


def _run(llm: LLM, batch: list[dict]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=24, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for i in range(len(batch))]
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def test_the_runner_needs_nothing_but_pickled_payloads(tiny_qwen3_dir):
    batch = _prompts(8, 3)
    want = _run(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=256), batch)
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=12)  # tight: decodes preempt
    runner = llm.engine.core.model_executor.runner
    apply, execute, seen = runner.apply, runner.execute, []

    kv = llm.engine.core.kv

    def apply_pickled(update: StateUpdate) -> None:
        assert_plain(update, live=frozenset(id(t) for g in kv.groups for t in g.tables.values()))
        seen.append(update)
        apply(pickle.loads(pickle.dumps(update)))

    def execute_pickled(specs: Any) -> Any:
        assert_plain(specs, "chunk specs")
        return execute(pickle.loads(pickle.dumps(specs)))

    runner.apply = apply_pickled
    runner.execute = execute_pickled
    assert _run(llm, batch) == want
    assert llm.stats.num_preemptions > 0
    resumed = [n.request_id for u in seen for n in u.new_requests]
    assert len(resumed) > len(set(resumed))  # preempted requests came back whole
    assert not runner.requests  # every finished request was forgotten


def _drafting_ngrams(llm: LLM) -> LLM:
    """Every n-gram proposal drafted (the gate prices drafts by measured step times, which would make the rows
    that draft depend on the machine's load)."""
    speculator = llm.engine.core.scheduler.speculator
    speculator.arms.drafts_now = lambda rows: True
    speculator.gate.allows = lambda request_id, k, rows: k
    return llm


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_runner_appends_the_tokens_it_samples(tiny_qwen3_dir, async_scheduling):
    """The engine sends a request's tokens once, when the runner gets it whole (new, or back after a
    preemption); afterwards only blocks. The runner's copy still equals the engine's after every step, token for
    token, with accepted n-gram drafts, penalties, seeded sampling and preemption in the mix, and the greedy
    outputs equal a roomy engine's. (Not the seeded ones: recomputing a preempted request sums in other shapes,
    so its logits may move by float rounding, which a near tie in a seeded draw can turn into another token.)"""
    rng = random.Random(5)
    roomy = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=256)
    # Prompts n-gram lookup drafts well on: a head, the model's greedy continuation, other tokens, the head again.
    heads = [{"prompt_token_ids": [rng.randrange(500) for _ in range(10)]} for _ in range(8)]
    conts = roomy.generate(heads, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    batch = [{"prompt_token_ids": h["prompt_token_ids"] + c.outputs[0].token_ids
              + [rng.randrange(500) for _ in range(rng.randrange(2, 8))] + h["prompt_token_ids"]}
             for h, c in zip(heads, conts)]
    params = [SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, repetition_penalty=1.3) if i % 3 == 0
              else SamplingParams(temperature=0.8, seed=11 + i, max_tokens=28, ignore_eos=True) if i % 3 == 1
              else SamplingParams(temperature=0, max_tokens=28, ignore_eos=True) for i in range(len(batch))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    want = [o.outputs[0].token_ids for o in roomy.generate(batch, params, use_tqdm=False)]
    llm = _drafting_ngrams(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=14,
                               async_scheduling=async_scheduling, speculative_config=spec))
    core = llm.engine.core
    runner = core.model_executor.runner
    apply, step = runner.apply, core.step
    diffs = checked = 0

    def counting_apply(update: StateUpdate) -> None:
        nonlocal diffs
        diffs += len(update.diffs)
        apply(update)

    def checked_step() -> Any:
        nonlocal checked
        outs = step()
        if core._ahead is None:  # (a step in flight: the runner is a token ahead of the engine, by design)
            for req in core.scheduler.running:
                if req.request_id in runner.requests.requests:
                    held = runner.requests[req.request_id]
                    assert held.prompt + held.output == req.all_token_ids, req.request_id
                    checked += 1
        return outs

    runner.apply, core.step = counting_apply, checked_step
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert [got[i] for i in greedy] == [want[i] for i in greedy]
    assert checked > 50
    assert llm.stats.num_preemptions > 0
    assert llm.stats.spec_decode_num_accepted_tokens > 0
    # A request the runner holds is sent something only when a block of its table is new.
    assert diffs * 2 < checked
