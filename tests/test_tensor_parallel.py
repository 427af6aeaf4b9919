"""Tensor parallelism over torch.distributed (gloo on CPU): greedy tokens at tensor_parallel_size 2 and 4 equal
tensor_parallel_size 1 and HF transformers, for a dense Qwen3 whose 2 KV heads are replicated at TP 4 and for
Qwen3-MoE at TP 2, chunked and under preemption; configs that cannot be split are refused; no rank outlives
its engine; kill -9 of rank 1 under load is survived as an engine death."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.distributed.parallel_state import TensorParallel
from ladle.models.loading.tensor_parallel import kv_heads_of_rank
from server_harness import ServerProcess, stream_events

pytestmark = [pytest.mark.slow]

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Chunked (19-token chunks in 64-token steps), and about 40 + 24 tokens = 4 blocks per request in a pool of 9:
# it holds 2 of the 6 requests, so decodes preempt.
PRESSED = dict(max_num_batched_tokens=64, max_prefill_length=19, num_kv_blocks=9)
LENS = [40, 33, 47, 40, 38, 45]


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lens]


def _worker_pids(parent: int) -> list[int]:
    """The tensor-parallel ranks a process started (its children running ladle.executor.tp_worker)."""
    pids = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"ladle.executor.tp_worker" in cmdline:
                pids.append(int(child))
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _generate(path: str, prompts: list[list[int]], tp: int, **kwargs) -> tuple[list[list[int]], int]:
    with LLM(path, tensor_parallel_size=tp, **kwargs) as llm:
        workers = _worker_pids(os.getpid())
        assert len(workers) == tp - 1
        tokens = ladle_tokens(llm, prompts, GREEDY)
        preemptions = llm.stats.num_preemptions
        assert llm.config.settings["tensor_parallel_size"].value == tp
    assert not any(_alive(p) for p in workers), "a rank outlived LLM.shutdown()"
    return tokens, preemptions


def test_kv_heads_are_shared_out_or_replicated():
    assert [kv_heads_of_rank(8, TensorParallel(r, 4)) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [kv_heads_of_rank(2, TensorParallel(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="neither a divisor nor a multiple"):
        kv_heads_of_rank(2, TensorParallel(0, 3))


def test_dense_qwen3_at_tp_2_and_4_equals_tp_1_and_hf(tiny_qwen3_dir, hf_qwen3):
    prompts = _prompts(LENS, seed=7)
    want = [hf_greedy(hf_qwen3, p, NEW_TOKENS) for p in prompts]
    one, _ = _generate(tiny_qwen3_dir, prompts, 1, **PRESSED)
    assert one == want
    for tp in (2, 4):  # at 4, each of the 2 KV heads is replicated on two ranks
        tokens, preemptions = _generate(tiny_qwen3_dir, prompts, tp, **PRESSED)
        assert tokens == want, f"tensor_parallel_size {tp}"
        assert preemptions > 0


def test_qwen3_moe_at_tp_2_equals_tp_1_and_hf(moe_dir):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    prompts = _prompts(LENS, seed=8)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert _generate(moe_dir, prompts, 1, **PRESSED)[0] == want
    tokens, preemptions = _generate(moe_dir, prompts, 2, **PRESSED)
    assert tokens == want and preemptions > 0


def test_a_size_that_does_not_split_the_heads_is_refused_and_leaves_no_rank(tiny_qwen3_dir):
    before = set(_worker_pids(os.getpid()))
    with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible by tensor_parallel_size 3"):
        LLM(tiny_qwen3_dir, tensor_parallel_size=3)
    deadline = time.monotonic() + 10
    while set(_worker_pids(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_worker_pids(os.getpid())) - before


def test_kill_9_of_rank_1_under_load_restarts_the_group(tiny_qwen3_dir, tmp_path):
    srv = ServerProcess(tiny_qwen3_dir, tmp_path, "--tensor-parallel-size", "2", "--max-model-len", "2048",
                        "--num-kv-blocks", "256", "--shutdown-timeout", "1").start(timeout=180)
    try:
        engine = srv.engine_pid()
        (rank1,) = _worker_pids(engine)

        async def streamer(http: httpx.AsyncClient, i: int, started: asyncio.Event) -> list:
            body = {"prompt": f"Tell me a long story, {i}", "max_tokens": 1500, "ignore_eos": True}
            return await stream_events(http, body, lambda events: len(events) >= 2 and started.set())

        async def run() -> list:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as http:
                started = [asyncio.Event() for _ in range(4)]
                streams = [asyncio.create_task(streamer(http, i, ev)) for i, ev in enumerate(started)]
                await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
                os.kill(rank1, signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*streams), 20)

        for events in asyncio.run(run()):
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_restarting", events[-3:]
        body = srv.wait_health(200, 120)
        assert body["engine_pid"] != engine and body["engine_restarts"] == 1
        assert not _alive(engine) and not _alive(rank1)
        assert len(_worker_pids(body["engine_pid"])) == 1  # the new group has its own rank 1
        ok = srv.post("/v1/completions", {"prompt": "after the restart", "max_tokens": 5, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        new_rank1 = _worker_pids(body["engine_pid"])
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while any(map(_alive, new_rank1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, new_rank1)), "a rank outlived the server"


def test_plan_shows_each_ranks_own_plan(tiny_qwen3_dir, capsys):
    from ladle.entrypoints.cli import main

    assert main(["plan", "--model", tiny_qwen3_dir, "--tensor-parallel-size", "2", "--max-model-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "tensor_parallel_size" in out and "tensor-parallel ranks, each planned on its own" in out
    ranks = [line for line in out.splitlines() if line.strip().startswith(("rank 0:", "rank 1:"))]
    assert len(ranks) == 2 and all("KV pool" in line and "weights" in line for line in ranks)
    assert not _worker_pids(os.getpid())


def test_an_explicit_setting_tensor_parallelism_cannot_honour_is_refused(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="async_scheduling cannot be used with tensor_parallel_size > 1"):
        LLM(tiny_qwen3_dir, tensor_parallel_size=2, async_scheduling=True)
    assert not _worker_pids(os.getpid())


def test_a_failure_inside_the_sharded_forward_ends_the_engine_instead_of_retrying(tiny_qwen3_dir):
    """Retrying would send rank 0 into collectives the other rank is not in: the step must fail at once."""
    from ladle.executor.tensor_parallel import TensorParallelError

    with LLM(tiny_qwen3_dir, tensor_parallel_size=2, max_model_len=512) as llm:
        model = llm.engine.core.model_executor.runner.model

        def broken(*args, **kwargs):
            raise MemoryError("injected inside the forward")

        model.forward = broken
        with pytest.raises(TensorParallelError, match="injected inside the forward"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)
        assert llm.stats.oom_retries == 0
