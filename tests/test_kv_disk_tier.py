"""The prefix cache's disk tier (kv_disk_cache_dir): every cached block is written through to disk; a session
whose blocks left the device pool and the host tier, or whose engine restarted (or was killed with -9), reads them
back and computes only what is new, with the tokens a cold run gives. A torn, truncated, stale or foreign entry
is a counted miss, never a wrong token."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.entrypoints.openai.metrics import ServerMetrics
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

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Sessions of ~100-160 tokens on a pool of 16 blocks of 16 and a host tier of 4 blocks: both forget them.
SMALL = dict(max_num_batched_tokens=64, num_kv_blocks=16)


def _meta(tokens: tuple[int, ...] = (1, 2, 3, 4), identity: str = "model-a") -> EntryMeta:
    parent = chain_digest(root_digest(identity), (9, 9, 9, 9))
    return EntryMeta(identity, 0, chain_digest(parent, tokens), parent, tokens)


def _pages() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g).to(torch.bfloat16)]


def test_an_entry_reads_back_bit_for_bit(tmp_path):
    pages, meta = _pages(), _meta()
    path = str(tmp_path / "e.kv")
    write_entry(path, meta, pages)
    got = read_entry(path, meta, [tensor_spec(p) for p in pages])
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, pages))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # written under a temporary name, renamed


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "checksum"),
    ("flip_payload_byte", "checksum"),
    ("magic", "magic"),
    ("garbage_header", "header"),
])
def test_a_torn_or_damaged_entry_is_refused(tmp_path, damage, reason):
    pages, meta = _pages(), _meta()
    path = str(tmp_path / "e.kv")
    write_entry(path, meta, pages)
    data = bytearray(Path(path).read_bytes())
    if damage == "truncate":
        data = data[:-7]
    elif damage == "flip_payload_byte":
        data[-3] ^= 0x40
    elif damage == "magic":
        data[:4] = b"XXXX"
    else:
        data[14:30] = b"}" * 16
    Path(path).write_bytes(bytes(data))
    with pytest.raises(EntryMismatch, match=reason):
        read_entry(path, meta, [tensor_spec(p) for p in pages])


@pytest.mark.parametrize("other, reason", [
    (dict(tokens=(1, 2, 3, 5)), "digest"),  # another prefix's block under this name: its tokens differ
    (dict(identity="model-b"), "identity"),  # another model's entry
])
def test_a_stale_or_foreign_entry_is_refused(tmp_path, other, reason):
    pages = _pages()
    path = str(tmp_path / "e.kv")
    write_entry(path, _meta(**other), pages)
    with pytest.raises(EntryMismatch, match=reason):
        read_entry(path, _meta(), [tensor_spec(p) for p in pages])


def test_pages_of_another_shape_are_refused(tmp_path):
    pages, meta = _pages(), _meta()
    path = str(tmp_path / "e.kv")
    write_entry(path, meta, pages)
    with pytest.raises(EntryMismatch, match="shapes"):
        read_entry(path, meta, [("torch.float32", (4, 2, 8))] * 2)


def test_file_names_round_trip_and_strangers_are_ignored():
    digest = chain_digest(root_digest("m"), (1, 2))
    assert parse_name(f"{digest.hex()}.3.kv") == (digest, 3)
    assert parse_name("notes.txt") is None and parse_name("abc.0.kv") is None


def _sessions(llm: LLM, sessions: int, turns: int, seed: int = 0, first_turn: int = 0) -> tuple[list, list]:
    """Sessions sharing a prefix, taking turns (each appends the reply and a tool result). Returns every reply
    and each turn's (prompt tokens, cached tokens)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(500) for _ in range(48)]
    history = {s: prefix + [rng.randrange(500) for _ in range(30)] for s in range(sessions)}
    outs, counts = [], []
    for turn in range(turns):
        for s in range(sessions):
            out = llm.generate([{"prompt_token_ids": history[s]}], GREEDY, use_tqdm=False)[0]
            reply = list(out.outputs[0].token_ids)
            outs.append(reply)
            if turn >= first_turn:
                counts.append((len(history[s]), out.num_cached_tokens))
            history[s] = history[s] + reply + [rng.randrange(500) for _ in range(12)]
    return outs, counts


@pytest.fixture
def cold(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=256, enable_prefix_caching=False)
    return _sessions(llm, 6, 3)[0]


def test_sessions_hit_the_disk_tier_past_the_host_tier_and_across_a_restart(tiny_qwen3_dir, tmp_path, cold):
    disk = str(tmp_path / "kv")
    with LLM(tiny_qwen3_dir, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk) as llm:
        got, counts = _sessions(llm, 6, 3)
        tier = llm.engine.core.kv.disk
        assert tier is not None and tier.num_stored > 0 and tier.num_loaded > 0 and tier.num_misses == 0
        # Later turns compute about what is new: their histories came back from the host tier or the disk.
        later = counts[6:]
        assert sum(n - c for n, c in later) < 0.35 * sum(n for n, _ in later)
        setting = llm.config.settings["kv_disk_cache_size"]
        assert setting.source == "derived" and "free in" in setting.reason
    assert got == cold
    stored = [n for n in os.listdir(llm.config.kv_disk.directory) if n.endswith(".kv")]
    assert len(stored) == tier.num_stored - tier.num_evicted

    # A new engine (a restart): every session's first turn again hits what the last engine wrote.
    with LLM(tiny_qwen3_dir, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk) as again:
        replay, counts = _sessions(again, 6, 3)
        snap = again.engine.core.snapshot()
    assert replay == cold
    # Each first turn (78 tokens) hits its 4 full blocks, the very first request too: from the disk only.
    assert [c for _, c in counts[:6]] == [64] * 6
    assert snap.kv_disk_loaded_blocks > 0 and snap.kv_disk_misses == 0
    metrics = ServerMetrics("tiny")
    metrics.on_snapshot(1, snap)
    text = metrics.render().decode()
    assert f'ladle:kv_disk_loaded_blocks_total{{model_name="tiny"}} {float(snap.kv_disk_loaded_blocks)}' in text


def test_damaged_entries_are_counted_misses_and_tokens_stay_exact(tiny_qwen3_dir, tmp_path, cold):
    disk = str(tmp_path / "kv")
    with LLM(tiny_qwen3_dir, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk) as llm:
        _sessions(llm, 6, 1)
        directory = llm.config.kv_disk.directory
    names = sorted(n for n in os.listdir(directory) if n.endswith(".kv"))
    for i, name in enumerate(names):  # every entry torn, flipped, or replaced by another entry's bytes
        path = os.path.join(directory, name)
        data = bytearray(Path(path).read_bytes())
        if i % 3 == 0:
            data = data[: len(data) // 2]
        elif i % 3 == 1:
            data[-5] ^= 0x01
        else:
            data = bytearray(Path(directory, names[(i + 1) % len(names)]).read_bytes())
        Path(path).write_bytes(bytes(data))
    with LLM(tiny_qwen3_dir, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk) as again:
        got, _ = _sessions(again, 6, 1)
        snap = again.engine.core.snapshot()
        # Then the recomputed blocks are written afresh, and read back where the later turns need them.
        later, _ = _sessions(again, 6, 3)
    assert got == cold[:6] and later == cold
    assert snap.kv_disk_misses > 0 and snap.kv_disk_loaded_blocks == 0


def test_another_models_entries_are_never_read(tiny_qwen3_dir, tmp_path):
    """Two checkpoints of one shape, different weights, one directory: each keeps its own entries."""
    from ladle.demo import build_checkpoint

    other = build_checkpoint(tmp_path / "other", "qwen3", vocab_size=512, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                             max_position_embeddings=4096, tie_word_embeddings=True, seed=1)
    disk = str(tmp_path / "kv")
    with LLM(tiny_qwen3_dir, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk) as llm:
        _sessions(llm, 2, 1)
    want = _sessions(LLM(other, max_num_batched_tokens=64, num_kv_blocks=256), 2, 2)[0]
    with LLM(other, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk) as llm2:
        got, _ = _sessions(llm2, 2, 2)
        snap = llm2.engine.core.snapshot()
        assert llm2.config.kv_disk.directory != llm.config.kv_disk.directory
    assert got == want and snap.kv_disk_loaded_blocks == 0 and snap.kv_disk_misses == 0


def test_the_tier_stays_within_its_size_and_deletes_the_oldest(tiny_qwen3_dir, tmp_path, cold):
    disk = str(tmp_path / "kv")
    with LLM(tiny_qwen3_dir, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk,
             kv_disk_cache_size="200KiB") as llm:
        got, _ = _sessions(llm, 6, 3)
        tier = llm.engine.core.kv.disk
        assert tier.num_evicted > 0 and tier.num_bytes <= 200 * 1024
    assert got == cold
    on_disk = sum(os.path.getsize(os.path.join(tier.directory, n)) for n in os.listdir(tier.directory))
    assert on_disk <= 200 * 1024 * 1.1  # (the index counts headers by estimate)


def test_reset_prefix_cache_deletes_the_disk_entries(tiny_qwen3_dir, tmp_path):
    disk = str(tmp_path / "kv")
    with LLM(tiny_qwen3_dir, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk) as llm:
        _sessions(llm, 2, 1)
        assert llm.reset_prefix_cache()
        _, counts = _sessions(llm, 2, 1)
        directory = llm.config.kv_disk.directory
    assert all(c == 0 for _, c in counts[:1])
    with LLM(tiny_qwen3_dir, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk) as again:
        assert again.engine.core.kv.disk.num_bytes > 0  # only the entries written after the reset
    assert os.path.isdir(directory)


_KILLED = textwrap.dedent("""
    import os, random, signal, sys
    from ladle import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_num_batched_tokens=64, num_kv_blocks=16, kv_offloading_size="32KiB",
              kv_disk_cache_dir=sys.argv[2])
    rng = random.Random(0)
    prefix = [rng.randrange(500) for _ in range(48)]
    for s in range(6):
        llm.generate([{"prompt_token_ids": prefix + [rng.randrange(500) for _ in range(30)]}],
                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.engine.core.model_executor.runner.disk_writer.flush()  # the writes asked for have landed; nothing closed
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_entries_survive_kill_9(tiny_qwen3_dir, tmp_path, cold):
    disk = str(tmp_path / "kv")
    run = subprocess.run([sys.executable, "-c", _KILLED, tiny_qwen3_dir, disk], capture_output=True, timeout=300)
    assert run.returncode == -9, run.stderr.decode()[-2000:]
    with LLM(tiny_qwen3_dir, **SMALL, kv_offloading_size="32KiB", kv_disk_cache_dir=disk) as again:
        got, counts = _sessions(again, 6, 3)
        snap = again.engine.core.snapshot()
    assert got == cold
    assert snap.kv_disk_loaded_blocks > 0 and snap.kv_disk_misses == 0
    # Each first turn (78 tokens) hits its 4 full blocks, the very first request too: from the disk only.
    assert [c for _, c in counts[:6]] == [64] * 6


@pytest.mark.parametrize("bad, message", [
    (dict(kv_disk_cache_dir="{tmp}"), "kv_offloading_size too"),
    (dict(kv_disk_cache_size="1GiB"), "kv_disk_cache_dir is not given"),
    (dict(kv_disk_cache_dir="{tmp}", kv_offloading_size="32KiB", kv_disk_cache_size="1KiB"), "holds no block"),
    (dict(kv_disk_cache_dir="{tmp}", kv_offloading_size="32KiB", kv_disk_cache_size="lots"), "kv_disk_cache_size"),
])
def test_a_disk_tier_that_cannot_work_is_refused_by_name(tiny_qwen3_dir, tmp_path, bad, message):
    bad = {k: v.format(tmp=tmp_path / "kv") for k, v in bad.items()}
    with pytest.raises(ValueError, match=message):
        LLM(tiny_qwen3_dir, num_kv_blocks=24, **bad)

