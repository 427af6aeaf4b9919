"""The persistent host block tables: incremental rows equal the KV manager's tables at every step, through
growth, a table replaced after preemption, and row reuse when more requests pass through than rows exist."""
import random

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.worker.block_table import BlockTableBuffer


def check(table: torch.Tensor, tables: list[list[int]], widths: list[int]) -> None:
    assert table.dtype == torch.int32 and tuple(table.shape) == (len(tables), max(widths))
    for row, blocks, width in zip(table.tolist(), tables, widths):
        assert row[:width] == blocks[:width]


def test_rows_follow_growth_replacement_and_reuse() -> None:
    rng = random.Random(0)
    buf = BlockTableBuffer(max_rows=4, max_blocks=32)
    live: dict[str, list[int]] = {}
    for step in range(200):
        if len(live) < 3 or rng.random() < 0.1:
            live[f"r{step}"] = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]  # a new request
        for rid in list(live):
            r = rng.random()
            if r < 0.05:
                del live[rid]  # finished: never announced to the buffer
            elif r < 0.1:
                live[rid] = [rng.randrange(1000)]  # preempted and re-admitted: a new table object
            elif len(live[rid]) < 32:
                live[rid].append(rng.randrange(1000))  # grew in place
        ids = sorted(live, key=lambda _: rng.random())[:3]
        widths = [rng.randrange(1, len(live[i]) + 1) for i in ids]  # a step may need fewer than allocated
        check(buf.gather(ids, [live[i] for i in ids], widths), [live[i] for i in ids], widths)
    assert len(buf.rows) <= 4


def test_bad_steps_are_refused() -> None:
    buf = BlockTableBuffer(max_rows=2, max_blocks=4)
    with pytest.raises(ValueError, match="twice"):
        buf.gather(["a", "a"], [[1], [1]], [1, 1])
    with pytest.raises(ValueError, match="exceeds"):
        buf.gather(["a"], [[1] * 5], [5])


def test_engine_outputs_equal_with_and_without_the_buffer(tiny_qwen3_dir: str) -> None:
    """Preemption (9 blocks for 8 requests) and prefix-cache hits (shared prompts) through the engine's
    buffer give the tokens of a runner that rebuilds each step's tables from lists."""
    rng = random.Random(5)
    shared = [rng.randrange(500) for _ in range(33)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(500) for _ in range(rng.randrange(1, 8))]}
               for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = []
    for keep in (True, False):
        llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=9)
        if not keep:
            llm.engine.core.runner.block_table = None
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.stats.num_preemptions > 0 and llm.stats.prefix_cache_hits > 0
    assert outs[0] == outs[1]
