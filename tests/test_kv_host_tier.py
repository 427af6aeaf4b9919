"""The prefix cache's host tier (kv_offloading_size): cached blocks the device pool evicts move to host slots,
and a returning session's hit on them is copied back. Tokens equal the tier-off run's (and a roomy pool's);
returning sessions compute only what is new; the tier's own bookkeeping keeps slots a step still loads from."""
from __future__ import annotations

import random

import pytest

from ladle import LLM, SamplingParams
from ladle.entrypoints.openai.metrics import ServerMetrics
from ladle.kv_cache.host_tier import HostTier

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_host_tier_entries_are_kept_least_recently_used_first():
    dropped: list[int] = []
    tier = HostTier(2, dropped.append)
    assert tier.demote((10, 0), 5) and tier.demote((11, 0), 6)
    assert not tier.demote((10, 0), 7)  # held already (inclusive caching): the caller drops its own reference
    assert tier.take_transfers() == ([(5, 0), (6, 1)], [])
    tier.promote((11, 0), 3)  # now the most recent; (10, 0) is the least
    assert tier.demote((12, 0), 8)
    assert dropped == [10] and (10, 0) not in tier and tier.lookup((12, 0)) == 0
    assert tier.take_transfers() == ([(8, 0)], [(1, 3)])


def test_a_slot_a_step_still_loads_from_is_not_reused():
    dropped: list[int] = []
    tier = HostTier(1, dropped.append)
    assert tier.demote((10, 0), 5)
    tier.take_transfers()
    tier.promote((10, 0), 2)
    assert not tier.demote((11, 0), 6)  # the only slot is read by this step's load: the block is dropped
    assert dropped == [] and tier.take_transfers() == ([], [(0, 2)])
    assert tier.demote((11, 0), 6) and dropped == [10]  # the next step may reuse it


def test_slots_an_admission_holds_are_not_dropped():
    """Promoting a hit's host blocks allocates device blocks, which may evict (and demote) others: the hit's own
    entries stay until it took them all."""
    dropped: list[int] = []
    tier = HostTier(2, dropped.append)
    assert tier.demote((10, 0), 5) and tier.demote((11, 0), 6)
    tier.take_transfers()
    tier.hold({0, 1})
    assert not tier.demote((12, 0), 7) and dropped == []  # both slots held: the evicted block is simply dropped
    tier.promote((10, 0), 2)
    tier.promote((11, 0), 3)
    tier.release()
    assert tier.take_transfers() == ([], [(0, 2), (1, 3)])
    assert tier.demote((12, 0), 7) and dropped == [10]


def _sessions(llm: LLM, sessions: int, turns: int, seed: int = 0) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Sessions sharing a prefix, taking turns; each turn appends the reply and a tool result. Returns every
    turn's tokens and (new, computed) prompt tokens of each turn after the first."""
    rng = random.Random(seed)
    prefix = [rng.randrange(500) for _ in range(48)]
    history = {s: prefix + [rng.randrange(500) for _ in range(30)] for s in range(sessions)}
    outs, counts = [], []
    for turn in range(turns):
        for s in range(sessions):
            out = llm.generate([{"prompt_token_ids": history[s]}], GREEDY, use_tqdm=False)[0]
            reply = list(out.outputs[0].token_ids)
            outs.append(reply)
            if turn:
                counts.append((8 + 12, len(history[s]) - out.num_cached_tokens))
            history[s] = history[s] + reply + [rng.randrange(500) for _ in range(12)]
    return outs, counts


def test_returning_sessions_hit_the_host_tier_and_keep_their_tokens(tiny_qwen3_dir):
    roomy, _ = _sessions(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=256), 6, 3)
    off_out, off = _sessions(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=16), 6, 3)
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=16, kv_offloading_size="4MiB")
    on_out, on = _sessions(llm, 6, 3)
    assert on_out == off_out == roomy
    block = llm.config.block_size
    assert all(computed <= new + block for new, computed in on)  # only what is new, and a partial block
    assert sum(c for _, c in off) > 2 * sum(c for _, c in on)  # without the tier, histories are recomputed
    tier = llm.engine.core.kv.host
    assert tier is not None and tier.num_promoted > 0 and tier.num_demoted > 0
    setting = llm.config.settings["kv_offloading_size"]
    assert setting.source == "explicit" and "blocks" in str(setting.value)
    snap = llm.engine.core.snapshot()
    assert snap.kv_offload_promoted_blocks == tier.num_promoted and snap.kv_offload_demoted_blocks == tier.num_demoted
    assert snap.kv_offload_promoted_bytes == tier.num_promoted * llm.config.kv_layout.block_bytes
    metrics = ServerMetrics("tiny")
    metrics.on_snapshot(1, snap)
    text = metrics.render().decode()
    assert f'ladle:kv_offload_promoted_blocks_total{{model_name="tiny"}} {float(tier.num_promoted)}' in text


def test_a_host_tier_smaller_than_the_sessions_drops_the_oldest_and_stays_exact(tiny_qwen3_dir):
    """Two host blocks for six sessions' histories: entries are dropped and reused mid-run, hits shrink, and
    no token changes."""
    want, _ = _sessions(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=256), 6, 3, seed=1)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x fp32
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=24, kv_offloading_size=2 * block_bytes)
    got, _ = _sessions(llm, 6, 3, seed=1)
    assert got == want
    tier = llm.engine.core.kv.host
    assert tier is not None and tier.num_slots == 2 and tier.num_dropped > 0


def test_qwen3_5_hits_through_the_host_tier_keep_their_tokens(q35_dir):
    """A model with per-request state: a hit also needs its state checkpoint, and the blocks the host tier gives
    back must hold what the cold run wrote."""
    path = q35_dir
    want, _ = _sessions(LLM(path, max_num_batched_tokens=64, num_kv_blocks=256), 4, 3, seed=2)
    llm = LLM(path, max_num_batched_tokens=64, num_kv_blocks=24, kv_offloading_size="1MiB")
    got, _ = _sessions(llm, 4, 3, seed=2)
    assert got == want


@pytest.mark.parametrize("bad, message", [
    (dict(kv_offloading_size="1KiB"), "holds no block"),
    (dict(kv_offloading_size="4MiB", enable_prefix_caching=False), "enable_prefix_caching is off"),
    (dict(kv_offloading_size="lots"), "kv_offloading_size"),
])
def test_a_host_tier_that_cannot_work_is_refused_by_name(tiny_qwen3_dir, bad, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_qwen3_dir, num_kv_blocks=24, **bad)


def test_concurrent_sessions_under_preemption_with_a_small_tier_keep_their_tokens(tiny_qwen3_dir):
    """Eight sessions submitted together each turn, a pool tight enough to preempt, and a tier of a few slots:
    hits, demotions, drops and promotions interleave within steps, and the tokens equal a roomy pool's."""
    rng = random.Random(3)
    prefix = [rng.randrange(500) for _ in range(40)]
    histories = [prefix + [rng.randrange(500) for _ in range(rng.randrange(10, 40))] for _ in range(8)]

    def run(llm: LLM) -> list[list[int]]:
        hist = [list(h) for h in histories]
        outs = []
        r = random.Random(4)
        for _ in range(3):
            got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": h} for h in hist],
                                                                      GREEDY, use_tqdm=False)]
            outs += got
            hist = [h + g + [r.randrange(500) for _ in range(r.randrange(5, 20))] for h, g in zip(hist, got)]
        return outs

    want = run(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=256))
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=14, kv_offloading_size=5 * block_bytes)
    assert run(llm) == want
    tier = llm.engine.core.kv.host
    assert tier is not None and tier.num_promoted > 0 and tier.num_dropped > 0
    assert llm.stats.num_preemptions > 0
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_tensor_parallel_ranks_keep_their_own_shards_in_the_host_tier(tiny_qwen3_dir):
    """Each rank's runner applies the same copies to its own KV shard: tokens equal one rank's."""
    want, _ = _sessions(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=256), 4, 3, seed=5)
    with LLM(tiny_qwen3_dir, tensor_parallel_size=2, max_num_batched_tokens=64, num_kv_blocks=16,
             kv_offloading_size="4MiB") as llm:
        got, counts = _sessions(llm, 4, 3, seed=5)
        tier = llm.engine.core.kv.host
        assert tier is not None and tier.num_promoted > 0
    assert got == want
    assert all(computed <= new + 16 for new, computed in counts)


def test_without_kv_offloading_size_cpu_derives_no_host_tier_and_says_why(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, num_kv_blocks=24)
    setting = llm.config.settings["kv_offloading_size"]
    assert (setting.value, setting.source) == ("off", "derived") and "host memory already" in setting.reason
    assert llm.engine.core.kv.host is None
    assert "kv_offloading_size" in llm.config.report()  # `ladle plan` prints this report
    off = LLM(tiny_qwen3_dir, num_kv_blocks=24, kv_offloading_size="0GiB")
    assert off.engine.core.kv.host is None and off.config.settings["kv_offloading_size"].source == "explicit"


def test_on_cuda_the_host_tier_is_derived_from_the_pool_and_free_host_memory():
    """Twice the device pool, within a quarter of the host's free memory, with its reason."""
    import torch

    from ladle.config.engine_args import EngineArgs
    from ladle.config.provenance import Provenance
    from ladle.kv_cache.specs import KVCacheLayout, paged_group
    from ladle.startup.memory import free_memory_bytes
    from ladle.startup.setup import _host_tier

    layout = KVCacheLayout((paged_group(),), 16)
    prov = Provenance(frozenset())
    blocks, _ = _host_tier(EngineArgs(model="m"), prov, layout, True, torch.device("cuda"), 100, 0, 64)
    assert blocks == min(200, free_memory_bytes(torch.device("cpu")) // 4 // layout.block_bytes)
    setting = prov.settings["kv_offloading_size"]
    assert setting.source == "derived" and "2x the device pool" in setting.reason and f"({blocks} blocks)" in setting.value
    huge, _ = _host_tier(EngineArgs(model="m"), Provenance(frozenset()), layout, True, torch.device("cuda"), 10**15, 0, 64)
    assert huge * layout.block_bytes <= free_memory_bytes(torch.device("cpu")) // 4 + layout.block_bytes
    assert _host_tier(EngineArgs(model="m"), Provenance(frozenset()), layout, False, torch.device("cuda"), 100, 0, 64) == (0, 0)
    # 0 turns the derived tier off, said as explicit; a negative size is still refused.
    off = Provenance(frozenset({"kv_offloading_size"}))
    assert _host_tier(EngineArgs(model="m", kv_offloading_size=0), off, layout, True, torch.device("cuda"), 100, 0,
                      64) == (0, 0)
    assert (off.settings["kv_offloading_size"].value, off.settings["kv_offloading_size"].source) == ("off", "explicit")
    with pytest.raises(ValueError, match="kv_offloading_size: cannot read"):
        _host_tier(EngineArgs(model="m", kv_offloading_size="-1"), off, layout, True, torch.device("cuda"), 100, 0, 64)


@pytest.mark.slow
def test_deepseek_v4_hits_through_the_host_tier_keep_their_tokens(dsv4_dir):
    """Sliding-window, compressed-sparse and heavily-compressed groups: each group's blocks are demoted and
    promoted under their own keys, a hit also needs its state checkpoint (the compressors' pending groups), and
    the tokens stay those of a roomy pool."""
    path = dsv4_dir
    want, _ = _sessions(LLM(path, max_num_batched_tokens=64, num_kv_blocks=256), 6, 3, seed=3)
    llm = LLM(path, max_num_batched_tokens=64, num_kv_blocks=14, kv_offloading_size="2MiB")
    got, _ = _sessions(llm, 6, 3, seed=3)
    assert got == want
    tier = llm.engine.core.kv.host
    assert tier is not None and tier.num_demoted > 0 and tier.num_promoted > 0


@pytest.mark.parametrize("model", ["qwen3_5", pytest.param("deepseek_v4", marks=pytest.mark.slow)])
def test_state_checkpoints_the_device_evicts_wait_in_the_host_tier(request, model):
    """Two device checkpoint slots for four sessions: the least recently used checkpoint is demoted to the host
    tier instead of dropped, and a returning session's hit takes a device slot again, loaded from the host copy
    (the Gated DeltaNet states, or DeepSeek-V4's compressor states and tail pages), with a roomy run's tokens."""
    path = request.getfixturevalue("q35_dir" if model == "qwen3_5" else "dsv4_dir")
    want, _ = _sessions(LLM(path, max_num_batched_tokens=64, num_kv_blocks=256), 4, 3, seed=4)
    llm = LLM(path, max_num_batched_tokens=64, num_kv_blocks=64, num_state_checkpoints=2,
              kv_offloading_size="4MiB")
    got, counts = _sessions(llm, 4, 3, seed=4)
    assert got == want
    tier = llm.engine.core.kv.host_checkpoints
    assert tier is not None and tier.num_slots >= 8, llm.config.settings["kv_offloading_size"]
    assert tier is not None and tier.num_demoted > 0 and tier.num_promoted > 0
    assert "state checkpoints" in llm.config.settings["kv_offloading_size"].value
    # Each later turn resumes at its last checkpoint: it computes its new tokens and what lies past that.
    block = llm.config.block_size
    assert all(computed <= new + 2 * block for new, computed in counts)
