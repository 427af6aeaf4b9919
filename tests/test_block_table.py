"""The persistent host block tables: rows written whole and then where they grow equal the tables they copy,
and the engine's tokens are those of a runner that rebuilds each step's tables from lists."""
import random

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.runner.block_table import BlockTableBuffer


def test_rows_follow_writes_and_growth() -> None:
    rng = random.Random(0)
    buf = BlockTableBuffer(max_rows=4, max_blocks=32)
    live = {row: [] for row in range(4)}
    for _ in range(200):
        row = rng.randrange(4)
        if rng.random() < 0.1:
            live[row] = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]  # a new request takes the row
            buf.write(row, 0, live[row])
        elif len(live[row]) < 32:
            added = [rng.randrange(1000) for _ in range(rng.randrange(1, 3))][: 32 - len(live[row])]
            buf.write(row, len(live[row]), added)  # grew: only the new entries are written
            live[row] += added
        rows = rng.sample(range(4), 3)
        width = max(1, min(len(live[r]) for r in rows))
        table = buf.gather(torch.tensor(rows), width)
        assert table.dtype == torch.int32 and tuple(table.shape) == (3, width)
        for got, r in zip(table.tolist(), rows):
            assert got[: len(live[r])] == live[r][:width]


def test_a_table_past_the_buffer_is_refused() -> None:
    buf = BlockTableBuffer(max_rows=2, max_blocks=4)
    with pytest.raises(ValueError, match="exceeds"):
        buf.write(0, 2, [1, 2, 3])


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
            llm.engine.core.model_executor.runner.requests.block_tables = None
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.stats.num_preemptions > 0 and llm.stats.prefix_cache_hits > 0
    assert outs[0] == outs[1]
