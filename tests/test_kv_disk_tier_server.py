"""`ladle serve` with the prefix cache's disk tier: after kill -9 of the engine (the supervisor starts a new one)
and after a clean restart of the whole server, each session's next turn is served its history from disk
(usage.prompt_tokens_details.cached_tokens), with the tokens a cold server gives."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from server_harness import ServerProcess, metric

pytestmark = [pytest.mark.server, pytest.mark.slow]

FLAGS = ("--max-num-batched-tokens", "64", "--num-kv-blocks", "16", "--max-model-len", "1024",
         "--kv-offloading-size", "64KiB")


def _turn(server: ServerProcess, history: list[int]) -> tuple[str, int]:
    r = server.post("/v1/completions", {"prompt": history, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _histories(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(500) for _ in range(48)]
    return [prefix + [rng.randrange(500) for _ in range(30)] for _ in range(4)]


def _wait_written(server: ServerProcess, directory: str, timeout: float = 60) -> None:
    """Every entry the engine asked its writer for is on disk (the files number its stored blocks)."""
    stored = metric(server.metrics(), "ladle:kv_disk_stored_blocks_total")
    deadline = time.monotonic() + timeout
    while sum(f.endswith(".kv") for _, _, files in os.walk(directory) for f in files) < stored:
        assert time.monotonic() < deadline, f"fewer than {stored} entries written in {timeout} s"
        time.sleep(0.1)


def test_sessions_come_back_from_disk_after_kill_9_and_a_clean_restart(tiny_qwen3_dir, tmp_path):
    disk = str(tmp_path / "kv")
    cold = ServerProcess(tiny_qwen3_dir, tmp_path, *FLAGS[:6], "--no-enable-prefix-caching").start()
    try:
        want = [_turn(cold, h)[0] for h in _histories()]
    finally:
        cold.stop()

    server = ServerProcess(tiny_qwen3_dir, tmp_path, *FLAGS, "--kv-disk-cache-dir", disk).start()
    try:
        assert [_turn(server, h)[0] for h in _histories()] == want
        _wait_written(server, disk)
        old = server.engine_pid()
        os.kill(old, signal.SIGKILL)
        time.sleep(0.5)
        body = server.wait_health(200, 90)
        assert body["engine_pid"] != old and body["engine_restarts"] == 1
        again = [_turn(server, h) for h in _histories()]
        assert [t for t, _ in again] == want
        # Every session's 4 full blocks, the first request's too: nothing in the new engine's memory held them.
        assert [c for _, c in again] == [64] * 4
        assert metric(server.metrics(), "ladle:kv_disk_loaded_blocks_total") > 0
    finally:
        server.stop()

    server = ServerProcess(tiny_qwen3_dir, tmp_path, *FLAGS, "--kv-disk-cache-dir", disk).start()
    try:
        again = [_turn(server, h) for h in _histories()]
        assert [t for t, _ in again] == want and [c for _, c in again] == [64] * 4
        assert metric(server.metrics(), "ladle:kv_disk_misses_total") == 0
    finally:
        server.stop()
