"""Tiered expert files read safely (ladle.experts.expert_files, issue 54 item 3): with moe_backing mmap, a
checkpoint file truncated, zeroed at its tail (mtime put back or not), replaced or removed after load ends the
requests that need its experts with an error naming the file and the expert, never with different tokens; the
engine keeps serving (no "steps in a row failed", no restart loop), experts already on the device keep serving the
load's weights, and a file already truncated at load is refused at startup naming it."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from ladle import LLM
from ladle.engine.core import MAX_FAILED_STEPS_IN_A_ROW
from ladle.experts.slice_checksum import ROW_WORDS, slice_checksum
from test_expert_tiering import GREEDY, TOP_K, _prompts, _qwen3_moe

ROUNDS = MAX_FAILED_STEPS_IN_A_ROW + 1  # rounds in which every request fails: more than end an engine in error
ZEROED = 200_000  # bytes at the file's end: the last MoE layer's experts and the tensors after them
# Every way a miss reads the file: fetched on the step's thread, ahead on the fetch thread, computed in place.
TIERS = {"offload": dict(moe_strategy="offload", moe_cache_size=TOP_K, moe_prefetch=False),
         "prefetch": dict(moe_strategy="offload", moe_cache_size=TOP_K, moe_prefetch=True),
         "cpu": dict(moe_strategy="cpu")}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, their greedy tokens with every expert resident)."""
    path = _qwen3_moe(tmp_path_factory.mktemp("expert_files"))
    prompts = _prompts([1, 9, 40], 3)
    with LLM(path, num_kv_blocks=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return path, prompts, [o.outputs[0].token_ids for o in outs]


def _copy(path: str, tmp: Path) -> tuple[str, str]:
    """A copy of the checkpoint to break, and its safetensors file."""
    out = shutil.copytree(path, tmp / "ckpt")
    return str(out), str(out / "model.safetensors")


def _served(llm: LLM, prompts: list[list[int]], want: list[list[int]]) -> list[str]:
    """The errors of the requests that failed; every other request got exactly the load's tokens."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    errors = []
    for out, tokens in zip(outs, want):
        if out.outputs[0].finish_reason == "error":
            errors.append(out.error)
        else:
            assert out.outputs[0].token_ids == tokens, "a changed expert file gave different tokens"
    return errors


def _assert_every_request_fails_naming(llm: LLM, prompts: list[list[int]], want: list[list[int]], file: str,
                                       problem: str) -> None:
    """Round after round every request fails, with the file, the expert and the problem named, and the engine
    goes on (a failure of the engine this often would have raised EngineStepError)."""
    for _ in range(ROUNDS):
        errors = _served(llm, prompts, want)
        assert len(errors) == len(prompts)
        for error in errors:
            assert file in error and "expert" in error and ".mlp.experts" in error and problem in error, error
            assert "restart the server" in error


def _other_file(path: str, tmp: Path) -> str:
    """The checkpoint's file with each layer's experts in another order: same names, shapes and size."""
    tensors = load_file(str(Path(path) / "model.safetensors"))
    for name, t in tensors.items():
        if ".experts.0." in name:
            other = name.replace(".experts.0.", ".experts.1.")
            tensors[name], tensors[other] = tensors[other], t
    out = tmp / "other.safetensors"
    save_file(tensors, str(out), metadata={"format": "pt"})
    return str(out)


def _swap(b: bytearray, i: int, j: int, n: int) -> None:
    b[i:i + n], b[j:j + n] = b[j:j + n], b[i:i + n]


ROW = 8 * ROW_WORDS
CHANGES = {  # each changes the bytes of a 3.5-row slice (as a checkpoint changed on disk would), never its length
    "zeroed tail": lambda b: b.__setitem__(slice(-5000, None), bytes(5000)),
    "one bit": lambda b: b.__setitem__(7000, b[7000] ^ 0x10),
    "rows swapped": lambda b: _swap(b, 0, ROW, ROW),
    "words swapped within a row": lambda b: _swap(b, 0, 1536, 1536),  # bf16 rows of 768, both in one 4 KiB row
    "in the tail past the last whole row": lambda b: b.__setitem__(-3, b[-3] ^ 1),
    "another tensor": lambda b: b.__setitem__(slice(None), np.random.default_rng(1).bytes(len(b))),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_slice_checksum_sees_each_change(change):
    data = bytearray(np.random.default_rng(0).bytes(3 * ROW + ROW // 2))
    before = slice_checksum(memoryview(data))
    CHANGES[change](data)
    assert slice_checksum(memoryview(data)) != before


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_truncated_expert_file_ends_only_the_requests_that_need_it_naming_it(source, tmp_path, tier):
    path, prompts, want = source
    ckpt, file = _copy(path, tmp_path)
    with LLM(ckpt, num_kv_blocks=128, moe_backing="mmap", **TIERS[tier]) as llm:
        assert _served(llm, prompts, want) == []
        os.truncate(file, os.path.getsize(file) - ZEROED)
        _assert_every_request_fails_naming(llm, prompts, want, file, "truncated")
        assert llm.stats.requests_failed == ROUNDS * len(prompts)


@pytest.mark.parametrize("mtime_put_back", [False, True])
def test_a_zeroed_tail_at_the_same_size_is_an_error_never_different_tokens(source, tmp_path, mtime_put_back):
    """With the mtime put back the file's identity is as loaded: the checksum is what catches it."""
    path, prompts, want = source
    ckpt, file = _copy(path, tmp_path)
    with LLM(ckpt, num_kv_blocks=128, moe_backing="mmap", **TIERS["offload"]) as llm:
        assert _served(llm, prompts, want) == []
        st = os.stat(file)
        with open(file, "r+b") as f:
            f.seek(st.st_size - ZEROED)
            f.write(bytes(ZEROED))
        if mtime_put_back:
            os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.path.getsize(file) == st.st_size
        _assert_every_request_fails_naming(llm, prompts, want, file,
                                           "differ from those read at load" if mtime_put_back else "written to")


@pytest.mark.parametrize("how", ["renamed over", "copied over", "removed"])
def test_a_replaced_or_removed_expert_file_is_an_error(source, tmp_path, how):
    """Renamed over or removed, the open descriptor would still read the old bytes; the checkpoint changed all
    the same, and a restart would serve the new one, so it is refused too."""
    path, prompts, want = source
    ckpt, file = _copy(path, tmp_path)
    other = _other_file(path, tmp_path)
    assert os.path.getsize(other) == os.path.getsize(file)
    with LLM(ckpt, num_kv_blocks=128, moe_backing="mmap", **TIERS["offload"]) as llm:
        assert _served(llm, prompts, want) == []
        if how == "renamed over":
            os.replace(other, file)
        elif how == "copied over":
            with open(other, "rb") as src, open(file, "r+b") as dst:  # in place: same inode, same size
                dst.write(src.read())
        else:
            os.remove(file)
        problem = {"renamed over": "another file replaced it", "copied over": "written to",
                   "removed": "the file was removed"}[how]
        _assert_every_request_fails_naming(llm, prompts, want, file, problem)


def test_experts_on_the_device_keep_serving_the_loaded_weights(source, tmp_path):
    """Slots hold bytes checked when they were filled: with every expert cached, a broken file costs nothing."""
    path, prompts, want = source
    ckpt, file = _copy(path, tmp_path)
    with LLM(ckpt, num_kv_blocks=128, moe_backing="mmap", moe_cache_size=16) as llm:  # 2 MoE layers x 8 experts
        assert _served(llm, prompts, want) == []
        misses = llm.stats.experts.misses
        os.truncate(file, os.path.getsize(file) - ZEROED)
        assert _served(llm, prompts, want) == []
        assert llm.stats.experts.misses == misses and llm.stats.requests_failed == 0


def test_async_scheduling_runs_a_launch_that_finds_a_changed_file_synchronously(source, tmp_path, caplog):
    """A decode step launched ahead whose expert read fails is taken again on the synchronous path, whose retries
    end the requests that need the expert: no engine error."""
    path, prompts, want = source
    ckpt, file = _copy(path, tmp_path)
    with LLM(ckpt, num_kv_blocks=128, moe_backing="mmap", async_scheduling=True, **TIERS["offload"]) as llm:
        core = llm.engine.core
        step = core.step

        def break_after_prefill() -> list:
            out = step()
            if core.stats.num_steps == 1:
                os.truncate(file, os.path.getsize(file) - ZEROED)
            return out

        core.step = break_after_prefill
        with caplog.at_level(logging.WARNING, logger="ladle"):
            errors = _served(llm, prompts, want)
        assert errors and all(file in e and "truncated" in e for e in errors)
        assert "launching a step; it runs synchronously" in caplog.text


def test_async_scheduling_with_a_file_tier_is_refused_for_a_model_with_state_layers(tmp_path):
    from test_qwen3_5 import MIXES, _build

    _build(tmp_path / "qwen3_5_moe", 7, **MIXES["moe"])
    with pytest.raises(ValueError, match="async_scheduling cannot be used with moe_backing mmap"):
        LLM(str(tmp_path / "qwen3_5_moe"), num_kv_blocks=64, moe_backing="mmap", moe_cache_size=TOP_K,
            async_scheduling=True)


def test_a_file_truncated_before_load_is_refused_at_startup_naming_it(source, tmp_path):
    path, _, _ = source
    ckpt, file = _copy(path, tmp_path)
    os.truncate(file, os.path.getsize(file) - ZEROED)
    with pytest.raises(ValueError, match="lies past the file's end") as e:
        LLM(ckpt, num_kv_blocks=128, moe_backing="mmap", **TIERS["offload"])
    assert file in str(e.value)


@pytest.mark.server
@pytest.mark.slow
def test_the_server_answers_each_request_with_the_files_error_and_never_restarts(source, tmp_path):
    from server_harness import ServerProcess, assert_error_envelope

    path, prompts, _ = source
    ckpt, file = _copy(path, tmp_path)
    server = ServerProcess(ckpt, tmp_path, "--num-kv-blocks", "128", "--moe-backing", "mmap", "--moe-cache-size",
                           str(TOP_K)).start()
    try:
        body = {"prompt": prompts[2], "max_tokens": 4, "temperature": 0}
        assert server.post("/v1/completions", body).status_code == 200
        pid = server.engine_pid()
        os.truncate(file, os.path.getsize(file) - ZEROED)
        for _ in range(ROUNDS + 1):
            r = server.post("/v1/completions", body)
            assert_error_envelope(r, 500)
            message = r.json()["error"]["message"]
            assert "<model>/model.safetensors" in message and ".mlp.experts" in message and "truncated" in message
            assert str(tmp_path) not in message, message  # the file is named, the server's disk not shown
        status, health = server.health()
        assert status == 200 and health["status"] == "ok", health
        assert health["engine_restarts"] == 0 and server.engine_pid() == pid
        assert server.log().count("cannot be read as the server loaded it") == 1  # the cause, logged once
    finally:
        server.stop()
