"""The runner lives on plain payloads: each step's StateUpdate and chunk specs survive a pickle round trip
(as they would on their way to a worker in another process) and the tokens do not change, with seeded
sampling, preemption (requests coming back whole) and prefix-cache hits in the mix."""
from __future__ import annotations

import pickle
import random

from ladle import LLM, SamplingParams
from ladle.request import Request
from ladle.worker.payload import StateUpdate


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
    runner = llm.engine.core.runner
    apply, execute, seen = runner.apply, runner.execute, []

    def apply_pickled(update: StateUpdate) -> None:
        assert not any(isinstance(x, Request) for x in vars(update).values())
        seen.append(update)
        apply(pickle.loads(pickle.dumps(update)))

    runner.apply = apply_pickled
    runner.execute = lambda specs: execute(pickle.loads(pickle.dumps(specs)))
    assert _run(llm, batch) == want
    assert llm.stats.num_preemptions > 0
    resumed = [n.request_id for u in seen for n in u.new_requests]
    assert len(resumed) > len(set(resumed))  # preempted requests came back whole
    assert not runner.requests  # every finished request was forgotten
