"""`ladle serve-replicas`: two ladle replicas behind one OpenAI endpoint on a local, loopback-only Ray
instance. Both replicas answer (each has its own engine process), completions work through Ray's proxy, and
SIGTERM leaves no engine behind."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.server, pytest.mark.slow]


def _free_port() -> int:
    """A free port below the kernel's ephemeral range (32768-60999 here): the ephemeral port this test once got
    was taken by one of Ray's own processes before Ray Serve's proxy could bind it ("Address already in use")."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_two_replicas_serve_one_endpoint(tiny_qwen3_dir, tmp_path):
    port = _free_port()
    log = (tmp_path / "replicas.log").open("w")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "ladle.entrypoints.cli", "serve-replicas", tiny_qwen3_dir,
                             "--num-replicas", "2", "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", "512", "--num-kv-blocks", "64"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    base = f"http://127.0.0.1:{port}"
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        with httpx.Client(base_url=base, timeout=10) as http:
            while len(pids) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "replicas.log").read_text()
                try:
                    r = http.get("/health")
                    if r.status_code == 200:
                        pids.add(r.json()["engine_pid"])
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            for i in range(4):
                r = http.post("/v1/completions", json={"prompt": f"replica test {i}", "max_tokens": 5,
                                                       "ignore_eos": True}, timeout=60)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
            assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)  # the launcher shuts Serve and Ray down in order
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 0, (tmp_path / "replicas.log").read_text()[-3000:]
    deadline = time.monotonic() + 30
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, pids)), "an engine process outlived serve-replicas"
