"""The disk tier for models whose prefix hits need state checkpoints (Qwen3.5's Gated DeltaNet layers, DeepSeek-V4's
compressors and compressed groups): every checkpoint registered is written to disk beside its blocks, a new engine
on the same directory resumes every session from disk (blocks and checkpoint, read into the host tier) with a cold
run's tokens, and a damaged checkpoint entry is a counted miss, never a wrong token."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.kv_cache.disk_format import (
    EntryMeta,
    EntryMismatch,
    chain_digest,
    parse_name,
    read_entry,
    root_digest,
    tensor_spec,
    write_entry,
)
from ladle.kv_cache.disk_hits import disk_reads
from ladle.kv_cache.group_tables import GroupTables
from ladle.kv_cache.host_tier import CHECKPOINT

# With each token's logprob: a tiny random model's greedy tokens barely depend on its Gated DeltaNet state (a
# restored state of noise kept them, in a trial), its logprobs do (by about 1e-2; a hit from a true checkpoint moves
# them by about 1e-6, the sums' order).
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
LOGPROB_TOLERANCE = 1e-4
# Prefill chunked at 32 tokens (so are checkpoints: every 32 tokens and where a prompt ends).
CHUNKED = dict(max_num_batched_tokens=32, num_kv_blocks=64)
TIER = dict(CHUNKED, kv_offloading_size="2MiB")
STATE = ".state.kv"
SEED = 1


@pytest.fixture(scope="module")
def qwen4_exp_dir(tmp_path_factory) -> str:
    from test_qwen4_exp import MIXES, _build

    path = tmp_path_factory.mktemp("qwen4_exp")
    _build(path, 7, **MIXES["gqa"])
    return str(path)


@pytest.fixture(scope="module")
def q35_cold(q35_dir) -> list[Replies]:
    """Three turns of four sessions with the prefix cache off: what every Qwen3.5 test's turns must give."""
    return _cold(q35_dir, 4, 3, SEED)


def _histories(sessions: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(500) for _ in range(40)]
    return [prefix + [rng.randrange(500) for _ in range(rng.randrange(30, 60))] for _ in range(sessions)]


Replies = list[list[tuple[int, float]]]  # per session: (token, its logprob) each


def _turn(llm: LLM, histories: list[list[int]], seed: int) -> tuple[Replies, list[int], list[list[int]]]:
    """One turn of every session, one after another: (replies, cached tokens, the next turn's histories: each
    with its reply and a tool result)."""
    rng = random.Random(seed)
    replies, cached = [], []
    for h in histories:
        result = llm.generate([{"prompt_token_ids": h}], GREEDY, use_tqdm=False)[0]
        out = result.outputs[0]
        assert out.logprobs is not None
        replies.append([(t, lp[t].logprob) for t, lp in zip(out.token_ids, out.logprobs)])
        cached.append(result.num_cached_tokens)
    return replies, cached, [h + [t for t, _ in r] + [rng.randrange(500) for _ in range(12)]
                             for h, r in zip(histories, replies)]


def _cold(path: str, sessions: int, turns: int, seed: int) -> list[Replies]:
    llm = LLM(path, **CHUNKED, enable_prefix_caching=False)
    histories, out = _histories(sessions, seed), []
    for turn in range(turns):
        replies, _, histories = _turn(llm, histories, seed + turn)
        out.append(replies)
    return out


def _same(got: Replies, want: Replies) -> bool:
    """The same tokens, and logprobs within the tolerance."""
    return all([t for t, _ in g] == [t for t, _ in w] and
               all(abs(a - b) < LOGPROB_TOLERANCE for (_, a), (_, b) in zip(g, w)) for g, w in zip(got, want))


def _state_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(STATE))


@pytest.mark.parametrize("model", ["qwen3_5", pytest.param("deepseek_v4", marks=pytest.mark.slow),
                                   pytest.param("qwen4_exp", marks=pytest.mark.slow)])
def test_a_new_engine_resumes_every_session_from_disk_with_the_cold_tokens(request, tmp_path, model):
    """Qwen3.5: Gated DeltaNet states; DeepSeek-V4: compressor states and compressed groups' tail pages, a sliding
    window; Qwen4-Exp: Gated DeltaNet and per-layer-embedding states (n-gram ids, int64), indexer keys."""
    if model == "qwen3_5":
        path, cold = request.getfixturevalue("q35_dir"), request.getfixturevalue("q35_cold")
    else:
        path = request.getfixturevalue("dsv4_dir" if model == "deepseek_v4" else "qwen4_exp_dir")
        cold = _cold(path, 4, 2, SEED)
    disk = str(tmp_path / "kv")
    with LLM(path, **TIER, kv_disk_cache_dir=disk) as first:
        replies, _, histories = _turn(first, _histories(4, SEED), SEED)
        first.engine.core.model_executor.runner.disk_writer.flush()
        directory = first.config.kv_disk.directory
        assert _state_files(directory), "no checkpoint was written to disk"
        assert first.engine.core.kv.disk.num_stored > len(_state_files(directory))  # blocks too
    assert _same(replies, cold[0])
    with LLM(path, **TIER, kv_disk_cache_dir=disk) as again:
        replies, cached, _ = _turn(again, histories, SEED + 1)
        tier = again.engine.core.kv.disk
        snap = again.engine.core.snapshot()
    assert _same(replies, cold[1])
    # Nothing was on the device or in the host tier: every hit came from disk, blocks and checkpoint.
    assert all(c > 0 for c in cached), str(cached)
    assert tier.num_loaded_checkpoints >= 4 and snap.kv_disk_loaded_blocks > tier.num_loaded_checkpoints
    assert snap.kv_disk_misses == 0


def test_sessions_the_device_and_the_host_tier_forget_come_back_from_disk(q35_dir, q35_cold, tmp_path):
    """A pool of 16 blocks with 2 checkpoint slots, a host tier of a few blocks and checkpoints: the sessions'
    later turns find their prefixes only on disk, within one engine."""
    cold = q35_cold
    small = dict(CHUNKED, num_kv_blocks=16, num_state_checkpoints=2, kv_offloading_size="64KiB")
    with LLM(q35_dir, **small, kv_disk_cache_dir=str(tmp_path / "kv")) as llm:
        histories, got, cached = _histories(4, SEED), [], []
        for turn in range(3):
            replies, hits, histories = _turn(llm, histories, SEED + turn)
            got.append(replies)
            if turn:
                cached += hits
        tier = llm.engine.core.kv.disk
        host = llm.engine.core.kv.host_checkpoints
        assert host is not None and host.num_slots < 4  # (fewer than the sessions)
    assert all(_same(g, c) for g, c in zip(got, cold))
    assert tier.num_loaded_checkpoints > 0 and tier.num_misses == 0
    assert all(c > 0 for c in cached), str(cached)


def test_a_damaged_checkpoint_entry_is_a_counted_miss_and_tokens_stay_exact(q35_dir, q35_cold, tmp_path):
    cold = q35_cold
    disk = str(tmp_path / "kv")
    with LLM(q35_dir, **TIER, kv_disk_cache_dir=disk) as first:
        _, _, histories = _turn(first, _histories(4, SEED), SEED)
        directory = first.config.kv_disk.directory
    for name in _state_files(directory):  # every checkpoint flipped in its payload; the blocks left whole
        data = bytearray(Path(directory, name).read_bytes())
        data[-9] ^= 0x10
        Path(directory, name).write_bytes(bytes(data))
    with LLM(q35_dir, **TIER, kv_disk_cache_dir=disk) as again:
        replies, cached, _ = _turn(again, histories, SEED + 1)
        tier = again.engine.core.kv.disk
    assert _same(replies, cold[1])
    assert tier.num_misses >= 4 and tier.num_loaded_checkpoints == 0
    # Blocks without a checkpoint serve no hit of this model: the first session computes all, the others hit only
    # the checkpoint it saved where their shared prefix's 32 tokens end.
    assert cached == [0, 32, 32, 32]


def test_checkpoint_entries_keep_to_the_size_and_go_with_reset(q35_dir, q35_cold, tmp_path):
    cold = q35_cold
    disk = str(tmp_path / "kv")
    with LLM(q35_dir, **TIER, kv_disk_cache_dir=disk, kv_disk_cache_size="160KiB") as llm:
        histories = _histories(4, SEED)
        got = []
        for turn in range(2):
            replies, _, histories = _turn(llm, histories, SEED + turn)
            got.append(replies)
        tier = llm.engine.core.kv.disk
        assert tier.num_evicted > 0 and tier.num_bytes <= 160 * 1024
        assert any(key[1] == CHECKPOINT for key in tier.index)
        runner = llm.engine.core.model_executor.runner
        runner.disk_writer.flush()
        on_disk = sum(os.path.getsize(os.path.join(tier.directory, n)) for n in os.listdir(tier.directory))
        assert on_disk <= 160 * 1024 * 1.1  # (the index counts headers by estimate)
        assert llm.reset_prefix_cache()
        runner.disk_writer.flush()
        assert not os.listdir(tier.directory)
    assert all(_same(g, c) for g, c in zip(got, cold))


def test_a_checkpoint_entry_reads_back_and_is_never_read_as_a_block(tmp_path):
    identity = "model-a"
    digest = chain_digest(root_digest(identity), (1, 2, 3, 4))
    rows = [torch.randn(2, 3), torch.randn(4).to(torch.bfloat16), torch.arange(5)]  # (int64: Qwen4-Exp's n-grams)
    meta = EntryMeta(identity, CHECKPOINT, digest, root_digest(identity), (1, 2, 3, 4))
    path = str(tmp_path / "e.kv")
    write_entry(path, meta, rows)
    specs = [tensor_spec(r) for r in rows]
    assert all(torch.equal(a, b) for a, b in zip(read_entry(path, meta, specs), rows))
    with pytest.raises(EntryMismatch, match="kind"):
        read_entry(path, EntryMeta(identity, 0, digest, root_digest(identity), (1, 2, 3, 4)), specs)
    assert parse_name(f"{digest.hex()}.state.kv") == (digest, CHECKPOINT)


def test_a_disk_read_fetches_only_what_the_deepest_checkpointed_hit_needs():
    """Blocks 0-5 on disk, checkpoints at blocks 2 and 4 (positions 48 and 80): the hit resumes at 80, reading a
    full group's blocks 0-4, a sliding group's window there (window 20: blocks 3 and 4), and that checkpoint;
    block 5, past any checkpoint, is left on disk."""
    groups = [GroupTables(None, (1, 1), 16), GroupTables(20, (1, 1), 16)]

    def on_disk(j: int, group: int) -> bool:
        return j in (2, 4) if group == CHECKPOINT else j < 6

    def nowhere(*_: int) -> None:
        return None

    reads = disk_reads(0, 7, groups, 16, nowhere, nowhere, on_disk, host_slots=64)
    assert sorted(reads) == sorted([(j, 0) for j in range(5)] + [(3, 1), (4, 1), (4, CHECKPOINT)])
    # Room for five blocks beside none held: the shallower hit (blocks 0-2, a window of 1-2) fits.
    assert sorted(disk_reads(0, 7, groups, 16, nowhere, nowhere, on_disk, host_slots=5)) == sorted(
        [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (2, CHECKPOINT)])
    # The device serves 3 blocks with a checkpoint already: only a deeper hit is read.
    assert disk_reads(3, 7, groups, 16, nowhere, nowhere, lambda j, g: g != CHECKPOINT and j < 6, 64) == []
