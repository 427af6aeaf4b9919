"""Nothing one request sends can hold the API process's event loop: stop strings are bounded and matched in
linear time, a big logprobs answer is bounded and built on a thread, and an engine step of seconds leaves
/health answering ("busy") within a second. /health is probed every 50 ms throughout, and its worst latency
printed (and held under a second).

One server serves this module: steps of a prompt of SLOW_TOKENS tokens or more spin in Python for SLOW_S
seconds, holding the GIL (tests/slow_step/sitecustomize.py), as a long CPU prefill would.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any, Awaitable

import httpx
import pytest

from server_harness import ServerProcess, assert_error_envelope

pytestmark = [pytest.mark.server, pytest.mark.slow]

SLOW_S, SLOW_TOKENS = 4.0, 1500
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 4096
MAX_LOGPROBS = 262144  # the server's default --max-logprobs-per-request


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    env = {"PYTHONPATH": str(Path(__file__).parent / "slow_step"), "LADLE_TEST_SLOW_STEP_S": str(SLOW_S),
           "LADLE_TEST_SLOW_STEP_TOKENS": str(SLOW_TOKENS)}
    srv = ServerProcess(tiny_qwen3_dir, tmp_path_factory.mktemp("event_loop"), "--num-kv-blocks", "1024",
                        "--max-model-len", "4096", "--max-num-batched-tokens", "2048", "--max-num-seqs", "64",
                        "--max-stop-strings", str(MAX_STOP_STRINGS), "--max-stop-chars", str(MAX_STOP_CHARS),
                        env=env).start()
    yield srv
    assert srv.stop() == 0, srv.log()


async def probed(server: ServerProcess, work: Awaitable[Any]) -> tuple[Any, list[float], list[dict]]:
    """Run work while /health is polled every 50 ms; its result, the probes' latencies and their bodies."""
    latencies: list[float] = []
    bodies: list[dict] = []
    task = asyncio.ensure_future(work)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        while not task.done():
            t0 = time.monotonic()
            r = await http.get("/health")
            latencies.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
            bodies.append(r.json())
            await asyncio.sleep(0.05)
    return await task, latencies, bodies


def test_stop_strings_beyond_the_limits_get_400_naming_them(server):
    r = server.post("/v1/completions", {"prompt": "hi", "stop": ["x%d" % i for i in range(MAX_STOP_STRINGS + 1)]})
    err = assert_error_envelope(r, 400, "invalid_value", "stop")
    assert "--max-stop-strings" in err["message"]
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                             "stop": ["y" * (MAX_STOP_CHARS // 2 + 1)] * 2})
    err = assert_error_envelope(r, 400, "invalid_value", "stop")
    assert "--max-stop-chars" in err["message"]


def test_the_original_flood_of_stop_strings_is_refused_without_holding_the_loop(server):
    """The report's case: hundreds of thousands of stop strings (3.3 MB here, under the 4 MiB body limit) with
    n=8 took a minute of the event loop; now a 400, and /health keeps answering meanwhile."""
    stops = [f"s{i:06d}x" for i in range(300_000)]

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            body = {"prompt": "hi", "n": 8, "max_tokens": 32, "stop": stops}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(3)))

    answers, latencies, _ = asyncio.run(probed(server, flood()))
    for r in answers:
        assert "--max-stop-strings" in assert_error_envelope(r, 400, "invalid_value", "stop")["message"]
    assert max(latencies) < 1.0, max(latencies)
    print(f"\n3 requests of 300,000 stop strings: 400 each; /health worst {max(latencies) * 1000:.0f} ms")


def test_stop_strings_at_the_limits_keep_health_fast(server):
    rng = random.Random(0)
    length = MAX_STOP_CHARS // MAX_STOP_STRINGS
    stops = ["".join(rng.choice("abcdefgh") for _ in range(length)) for _ in range(MAX_STOP_STRINGS)]
    rss_before = server.rss_mib()

    async def many() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            body = {"prompt": "stop me", "max_tokens": 200, "n": 8, "ignore_eos": True, "stop": stops}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(4)))

    answers, latencies, _ = asyncio.run(probed(server, many()))
    assert all(a.status_code == 200 for a in answers)
    assert all(c["finish_reason"] in ("length", "stop") for a in answers for c in a.json()["choices"])
    assert max(latencies) < 1.0, max(latencies)
    print(f"\n4 x n=8 with {MAX_STOP_STRINGS} stop strings of {length} chars: /health worst "
          f"{max(latencies) * 1000:.0f} ms; API RSS {rss_before:.0f} -> {server.rss_mib():.0f} MiB")


def test_logprobs_beyond_the_limit_get_400_and_at_it_are_built_off_the_loop(server):
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                             "top_logprobs": 20, "n": 128, "max_tokens": 256})
    err = assert_error_envelope(r, 400, "invalid_value", "top_logprobs")
    assert "--max-logprobs-per-request" in err["message"] and str(128 * 256 * 21) in err["message"]
    # With no max_tokens, the room the context leaves counts (chat's default; completions' is 16 tokens).
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                             "top_logprobs": 20, "n": 8})
    assert_error_envelope(r, 400, "invalid_value", "top_logprobs")
    r = server.post("/v1/completions", {"prompt": "hi", "logprobs": 5, "n": 128, "max_tokens": 400})
    assert_error_envelope(r, 400, "invalid_value", "logprobs")

    n, tokens = 64, MAX_LOGPROBS // (64 * 21)
    rss_before = server.rss_mib()

    async def big() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            return await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20, "n": n,
                "max_tokens": tokens, "ignore_eos": True})

    answer, latencies, _ = asyncio.run(probed(server, big()))
    assert answer.status_code == 200
    choices = answer.json()["choices"]
    assert len(choices) == n and all(len(c["logprobs"]["content"]) == tokens for c in choices)
    assert all(len(t["top_logprobs"]) == 20 for c in choices for t in c["logprobs"]["content"])
    assert max(latencies) < 1.0, max(latencies)
    print(f"\nn={n} x {tokens} tokens x 21 logprobs ({n * tokens * 21} entries, {len(answer.content) >> 20} MiB): "
          f"/health worst {max(latencies) * 1000:.0f} ms; API RSS {rss_before:.0f} -> {server.rss_mib():.0f} MiB")


def test_health_answers_busy_during_a_long_step_and_streams_resume_after_it(server):
    rss_before = server.rss_mib()
    async def long_prefill() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            return await http.post("/v1/completions", json={"prompt": [7] * (SLOW_TOKENS + 100), "max_tokens": 4,
                                                            "ignore_eos": True})

    answer, latencies, bodies = asyncio.run(probed(server, long_prefill()))
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    busy = [b for b in bodies if b["status"] == "busy"]
    assert busy and max(b["step_running_s"] for b in busy) >= SLOW_S - 1.5, bodies[-5:]
    assert "one engine step has run for" in busy[-1]["reason"]
    assert max(latencies) < 1.0, max(latencies)
    assert server.health()[1]["engine_restarts"] == 0  # a long step is not a hang
    print(f"\n{SLOW_S:g} s step holding the GIL: {len(busy)} of {len(bodies)} probes said busy; /health worst "
          f"{max(latencies) * 1000:.0f} ms; API RSS {rss_before:.0f} -> {server.rss_mib():.0f} MiB")
