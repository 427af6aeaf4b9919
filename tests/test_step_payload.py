"""The runner lives on plain payloads: each step's StateUpdate and chunk specs survive a pickle round trip
(as they would on their way to a worker in another process) and the tokens do not change, with seeded
sampling, preemption (requests coming back whole) and prefix-cache hits in the mix."""
from __future__ import annotations

import dataclasses
import pickle
import random
from typing import Any

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
