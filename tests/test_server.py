"""The OpenAI server end to end: the official client, stall-free chunked prefill, disconnects, bad input.
(Load, kill -9 and shutdown: test_server_resilience.py; the edge and fuzzing: test_server_hardening.py.)

One server (a subprocess on a free loopback port) serves this module; every wait has a deadline.
"""
from __future__ import annotations

import asyncio
import random
import re
import time
import uuid

import httpx
import openai
import pytest

from ladle import LLM, SamplingParams
from server_harness import ServerProcess, assert_error_envelope, metric, stream_tokens

pytestmark = [pytest.mark.server, pytest.mark.slow]

MAX_MODEL_LEN = 4096
CHUNK = 64


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    srv = ServerProcess(tiny_qwen3_dir, tmp_path_factory.mktemp("server"), "--max-num-batched-tokens", "128",
                        "--max-prefill-length", str(CHUNK), "--num-kv-blocks", "1024",
                        "--max-model-len", str(MAX_MODEL_LEN)).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def offline(tiny_qwen3_dir):
    # The server's chunking; greedy output may not depend on it, but an explicit budget also skips the
    # planner's profiling run.
    return LLM(tiny_qwen3_dir, num_kv_blocks=256, max_num_batched_tokens=128, max_prefill_length=CHUNK)


@pytest.fixture
def client(server):
    # No retries: a 503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_openai_client_completions_match_offline_generate(client, offline):
    model = client.models.list().data[0].id
    prompt = "The quick brown fox jumps over"
    want = offline.generate(prompt, _greedy(24), use_tqdm=False)[0].outputs[0]

    got = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)

    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)

    # A stop string cuts the text before it, exactly as offline.
    stop = next(s for s in (want.text[i:i + 2] for i in range(3, len(want.text) - 2))
                if s.strip() and "\ufffd" not in s)
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == want.text[:want.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text

    # n=2 sampled choices, with logprobs: the sampled token is among the reported ones.
    two = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=3, n=2,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in two.choices) == [0, 1]
    for c in two.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(t <= 0 for t in lp.token_logprobs)
        assert all(2 <= len(top) <= 3 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert two.usage.completion_tokens == 16

    # echo prepends the prompt; a list of prompts is a batch, its choices in prompt order.
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + want.text
    batch = client.completions.create(model=model, prompt=[prompt, "Hello"], max_tokens=24, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == want.text
    hello = offline.generate("Hello", _greedy(24), use_tqdm=False)[0]
    assert batch.choices[1].text == hello.outputs[0].text
    prompt_ids = offline.get_tokenizer().encode(prompt)
    assert batch.usage.prompt_tokens == len(prompt_ids) + len(hello.prompt_token_ids)
    by_ids = client.completions.create(model=model, prompt=prompt_ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == want.text


def test_openai_client_chat_matches_offline_chat(client, offline):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    want = offline.chat(messages, _greedy(20), use_tqdm=False)[0].outputs[0]
    model = client.models.list().data[0].id

    got = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)

    lp = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, n=2,
                                        logprobs=True, top_logprobs=2)
    assert [c.message.content for c in lp.choices] == [want.text[:len(lp.choices[0].message.content)]] * 2
    for c in lp.choices:
        assert len(c.logprobs.content) == 6
        for entry in c.logprobs.content:
            assert len(entry.top_logprobs) == 2
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy takes the top one


def test_long_prefill_does_not_stall_short_streams(server):
    long_ids = [random.Random(0).randrange(500) for _ in range(3600)]  # 57 chunks of 64 tokens

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            short_times: list[list[float]] = [[] for _ in range(3)]
            short = [asyncio.create_task(stream_tokens(http, {"prompt": f"Short request {i}:", "max_tokens": 300,
                                                               "temperature": 0, "ignore_eos": True}, short_times[i]))
                     for i in range(3)]
            deadline = time.monotonic() + 30
            while min(len(t) for t in short_times) < 3:
                assert time.monotonic() < deadline, "short streams never started"
                await asyncio.sleep(0.01)
            sent = time.monotonic()
            long_times: list[float] = []
            first: list[float] = []
            long_usage = await stream_tokens(http, {"prompt": long_ids, "max_tokens": 4, "temperature": 0,
                                                     "ignore_eos": True}, long_times, first)
            usages = await asyncio.gather(*short)
        prefill = first[0] - sent
        gaps = []
        for times in short_times:
            window = [t for t in times if sent <= t <= first[0]]
            assert len(window) >= 5, f"a short stream got only {len(window)} tokens during a {prefill:.2f} s prefill"
            gaps.append(max(b - a for a, b in zip(window, window[1:])))
        print(f"long prefill {prefill:.3f} s; short streams' largest inter-token gap {max(gaps) * 1000:.1f} ms")
        assert max(gaps) < prefill / 3, (gaps, prefill)
        assert long_usage["usage"]["prompt_tokens"] == 3600 and long_usage["usage"]["completion_tokens"] == 4
        assert all(u["usage"]["completion_tokens"] == 300 for u in usages)

    asyncio.run(asyncio.wait_for(run(), 120))


def test_disconnected_clients_free_their_kv_blocks(server):
    aborted_before = metric(server.metrics(), "ladle:request_success_total", finished_reason="abort")

    async def keeper(http: httpx.AsyncClient, i: int) -> dict:
        return await stream_tokens(http, {"prompt": f"Keeper {i} says", "max_tokens": 24, "ignore_eos": True,
                                           "temperature": 0.7, "seed": i}, [])

    async def leaver(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Leaver {i} says", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n >= 3:
                    break  # hang up mid-stream: leaving the block closes the connection

    async def impatient(i: int) -> None:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
                await http.post("/v1/chat/completions", timeout=1.5, json={
                    "messages": [{"role": "user", "content": f"Impatient {i}"}], "max_tokens": 4000,
                    "ignore_eos": True})

    async def run() -> list:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as http:
            jobs = [keeper(http, i) for i in range(10)] + [leaver(http, i) for i in range(8)]
            return await asyncio.gather(*jobs, impatient(0), impatient(1))

    results = asyncio.run(asyncio.wait_for(run(), 120))
    assert all(r["usage"]["completion_tokens"] == 24 for r in results[:10])
    body = server.wait_health(200, 15, kv_blocks_in_use=0, num_requests_running=0, num_requests_waiting=0)
    assert body["num_requests_in_flight"] == 0
    metrics = server.metrics()
    assert metric(metrics, "ladle:request_success_total", finished_reason="abort") - aborted_before >= 10
    assert metric(metrics, "ladle:kv_blocks_in_use") == 0


def test_bad_input_gets_4xx_envelopes_and_the_server_keeps_serving(server):
    chat = "/v1/chat/completions"
    cmpl = "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    too_long = server.post(cmpl, {"prompt": [7] * 4000, "max_tokens": 200})
    err = assert_error_envelope(too_long, 400, "context_length_exceeded")
    assert "4000" in err["message"] and "4200" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    assert_error_envelope(server.post(chat, {"messages": [{"role": "user", "content": "word " * 5000}]}), 400,
                     "context_length_exceeded")
    cases = [
        (cmpl, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        (cmpl, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (chat, {"messages": msgs, "temperature": -1}, "temperature"),
        (cmpl, {"prompt": "x", "top_p": 2}, "top_p"),
        (cmpl, {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        (cmpl, {"prompt": "x", "n": True}, "n"),
        (cmpl, {"prompt": 5}, "prompt"),
        (cmpl, {"prompt": "x", "stop": 5}, "stop"),
        (chat, {"messages": "hi"}, "messages"),
        (chat, {"messages": [{"role": "user", "content": 5}]}, "messages"),
        (chat, {"messages": [{"content": "no role"}]}, "messages"),
        (chat, {"messages": []}, "messages"),
        (chat, {}, "messages"),
        (cmpl, {"prompt": ""}, "prompt"),
        (cmpl, {"prompt": []}, "prompt"),
        (cmpl, {"prompt": "x", "logprobs": 99}, "logprobs"),
        (cmpl, {"prompt": "x", "n": 0}, "n"),
        (cmpl, {"prompt": "x", "stream": True, "presence_penalty": 9}, "presence_penalty"),
        (chat, {"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
        (cmpl, {"prompt": "x", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ]
    for path, body, param in cases:
        assert_error_envelope(server.post(path, body), 400, param=param)
    assert_error_envelope(server.post(cmpl, {"prompt": [99999]}), 400)  # a token id outside the vocabulary
    # A priority needs --scheduling-policy priority (this server runs fcfs), as in vLLM; a bad one is a 400 too.
    assert "scheduling" in assert_error_envelope(server.post(cmpl, {"prompt": "x", "priority": 2}), 400)["message"]
    assert_error_envelope(server.post(cmpl, {"prompt": "x", "priority": "high"}), 400, param="priority")
    assert_error_envelope(server.post(cmpl, {"prompt": "x", "model": "no-such-model"}), 404, "model_not_found", "model")
    assert_error_envelope(server.post(chat, content=b'{"messages": [{"role": "user",'), 400, "invalid_json")
    assert_error_envelope(server.post(chat, content=b"not json at all"), 400)
    assert_error_envelope(server.post(chat, content=b""), 400)
    assert_error_envelope(httpx.get(server.base_url + "/v1/no-such-route"), 404)
    assert httpx.get(server.base_url + "/openapi.json").json()["paths"].keys() >= {"/v1/completions",
                                                                                   "/v1/chat/completions"}
    ok = server.post(chat, {"messages": msgs, "max_tokens": 3, "num_speculative_tokens": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert server.health()[0] == 200


def test_metrics_report_engine_counters(server):
    server.post("/v1/completions", {"prompt": "count me", "max_tokens": 5, "ignore_eos": True})
    text = server.metrics()
    for name in ("ladle:num_requests_running", "ladle:num_requests_waiting", "ladle:kv_cache_usage_perc",
                 "ladle:time_to_first_token_seconds_bucket", "ladle:inter_token_latency_seconds_bucket",
                 "ladle:e2e_request_latency_seconds_bucket", "ladle:num_preemptions_total"):
        assert name in text, name
    assert metric(text, "ladle:prompt_tokens_total") > 0
    assert metric(text, "ladle:generation_tokens_total") >= 5
    assert metric(text, "ladle:prefill_chunks_total") >= 1
    steps = metric(text, "ladle:engine_steps_total")
    assert steps >= 5 and 0 <= metric(text, "ladle:engine_steps_with_lent_cpus_total") <= steps
    assert re.search(r"ladle:engine_healthy\{[^}]*\} 1\.0", text)


def test_session_hints_reach_the_prefix_cache(server):
    """prompt_cache_key, an x-session-affinity header and Anthropic's metadata.user_id each name a session whose
    prefix the engine keeps (ladle:prefix_cache_sessions); a second turn of a session is the same session."""
    tag = uuid.uuid4().hex
    before = metric(server.metrics(), "ladle:prefix_cache_sessions")
    msgs = [{"role": "user", "content": "keep this session's prefix for its next turn, " * 4}]
    for _ in range(2):
        r = server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "prompt_cache_key": f"k{tag}"})
        assert r.status_code == 200, r.text
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "a session by header", "max_tokens": 2},
                   headers={"x-session-affinity": f"h{tag}"}, timeout=60)
    assert r.status_code == 200, r.text
    model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = server.post("/v1/messages", {"model": model, "max_tokens": 2, "messages": msgs,
                                     "metadata": {"user_id": f"u{tag}"}})
    assert r.status_code == 200, r.text
    text = server.metrics()
    assert metric(text, "ladle:prefix_cache_sessions") == before + 3
    assert metric(text, "ladle:prefix_cache_kept_nodes") >= 1
    assert metric(text, "ladle:no_op_fields_total", field="prompt_cache_key") == 0
