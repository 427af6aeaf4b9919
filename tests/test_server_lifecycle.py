"""Server lifecycle: 429 on a full queue, SIGTERM drains then exits 0, the supervisor reports failed after
repeated engine failures but keeps the server up and retrying, and a bad setting ends the server at once with
the message."""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_harness import ServerProcess, assert_error_envelope, sse_events

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_queue_full_is_429_and_sigterm_drains_in_flight_requests(tiny_qwen3_dir, tmp_path):
    srv = ServerProcess(tiny_qwen3_dir, tmp_path, "--max-num-seqs", "1", "--max-queue-len", "1",
                        "--num-kv-blocks", "256", "--max-model-len", "2048").start()
    try:
        async def run() -> None:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:
                got: dict[str, list] = {"a": [], "b": []}

                async def stream(name: str, max_tokens: int, opened: asyncio.Event) -> None:
                    body = {"prompt": f"request {name}", "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": True}
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        opened.set()  # headers come only once the engine accepted the request
                        async for line in r.aiter_lines():
                            got[name] += sse_events([line])

                opened_a, opened_b = asyncio.Event(), asyncio.Event()
                a = asyncio.create_task(stream("a", 1000, opened_a))
                await asyncio.wait_for(opened_a.wait(), 30)
                while len(got["a"]) < 2:
                    await asyncio.sleep(0.01)
                b = asyncio.create_task(stream("b", 5, opened_b))  # waits: max_num_seqs is 1
                await asyncio.wait_for(opened_b.wait(), 30)
                r = await http.post("/v1/completions", json={"prompt": "one too many", "max_tokens": 2})
                assert_error_envelope(r, 429, "queue_full")

                assert len(got["a"]) < 1000, "request a finished before SIGTERM; the test proves nothing"
                srv.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                while True:  # new requests are refused once the signal is handled
                    r = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                    if r.status_code == 503:
                        assert_error_envelope(r, 503, "server_shutting_down")
                        break
                    assert time.monotonic() < deadline, r.text
                    await asyncio.sleep(0.05)
                assert (await http.get("/health")).status_code == 503
                await asyncio.wait_for(asyncio.gather(a, b), 60)
            for name, n in (("a", 1000), ("b", 5)):
                events = got[name]
                assert events[-1] == "[DONE]"
                text_events = [e for e in events[:-1] if e["choices"]]
                assert text_events[-1]["choices"][0]["finish_reason"] == "length", events[-3:]

        asyncio.run(asyncio.wait_for(run(), 120))
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        srv.kill()


def test_supervisor_reports_failed_after_failures_in_a_row_and_recovers_once_the_cause_is_gone(tiny_qwen3_dir,
                                                                                                 tmp_path):
    model = shutil.copytree(tiny_qwen3_dir, tmp_path / "model")
    srv = ServerProcess(str(model), tmp_path, "--num-kv-blocks", "64", "--max-model-len", "512",
                        "--engine-max-failures", "2", "--engine-restart-backoff", "0.1",
                        "--engine-max-backoff", "1").start()
    try:
        weights = model / "model.safetensors"
        kept = weights.rename(tmp_path / "kept.safetensors")  # every restart will now fail to load
        old_pid = srv.engine_pid()
        os.kill(old_pid, signal.SIGKILL)
        body = srv.wait_health(503, 60, engine_state="failed")
        assert "model.safetensors" in body["last_failure"], body
        r = srv.post("/v1/completions", {"prompt": "anyone?", "max_tokens": 2})
        err = assert_error_envelope(r, 503, "engine_dead")
        assert "tries again" in err["message"], err
        assert srv.proc.poll() is None  # the server itself stays up, reporting unhealthy
        assert "giving up on quick restarts" in srv.log()
        kept.rename(weights)  # the cause goes away: the next slow retry serves again
        body = srv.wait_health(200, 60)
        assert body["engine_pid"] != old_pid and body["engine_restarts"] >= 2, body
        assert srv.post("/v1/completions", {"prompt": "back", "max_tokens": 2}).status_code == 200
        assert srv.stop() == 0, srv.log()
    finally:
        srv.kill()


def test_a_first_start_that_fails_ends_the_server_after_one_try(tiny_qwen3_dir, tmp_path):
    """A setting only the memory plan can refuse exits 2; a corrupt checkpoint exits 1; neither restarts."""
    srv = ServerProcess(tiny_qwen3_dir, tmp_path, "--memory-budget", "64MiB", "--num-kv-blocks", "10000000"
                        ).start(wait_healthy=False)
    try:
        assert srv.proc.wait(60) == 2
        log = srv.log()
        assert "error: --num-kv-blocks=10000000 does not fit" in log and "restarting" not in log, log
        assert "Traceback" not in log
    finally:
        srv.kill()
    model = shutil.copytree(tiny_qwen3_dir, tmp_path / "corrupt")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    srv = ServerProcess(str(model), tmp_path, "--num-kv-blocks", "64").start(wait_healthy=False)
    try:
        assert srv.proc.wait(60) == 1
        log = srv.log()
        assert "truncated or corrupt" in log and "restarting" not in log and "Traceback" not in log, log
    finally:
        srv.kill()


def test_ladle_serve_model_as_vllm_serve_does(tiny_qwen3_dir, tmp_path):
    """`ladle serve DIR` (positional), the served name is DIR's name and DIR as given is served too (so `vllm
    bench serve --model DIR` finds it), the settings table is logged at the default level, and --access-log logs
    each request."""
    ladle = str(Path(sys.executable).parent / "ladle")
    srv = ServerProcess(tiny_qwen3_dir, tmp_path, "--num-kv-blocks", "64", "--access-log",
                        command=[ladle, "serve", tiny_qwen3_dir]).start()
    try:
        models = httpx.get(srv.base_url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [os.path.basename(tiny_qwen3_dir)]
        r = srv.post("/v1/completions", {"model": tiny_qwen3_dir, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        log = srv.log()
        assert "resolved engine settings" in log and re.search(r"num_kv_blocks +64 +explicit", log), log
        assert re.search(r'"GET /v1/models HTTP/1.1" 200', log), log
        assert srv.stop() == 0, srv.log()
    finally:
        srv.kill()
