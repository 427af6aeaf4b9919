"""The edges of starting and stopping a server: an API key from a file (trailing newline) works, a taken port
fails at once in one line, a truncated tokenizer.json is named, a broken chat template is the server's 500
(not the client's 400), and SIGHUP drains like SIGTERM. Plus the small answers: 415 for a body that is not
JSON, HEAD /health, no filesystem path in /v1/models, no megabyte echoed back in a 404, and no checkpoint
path in what a client sees (the served name is the directory's name; /health's failure text is redacted).

One server (its key given with a trailing newline) serves most of this module; the SIGHUP test stops it.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_harness import ServerProcess, assert_error_envelope, sse_events

pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "edge-key-42"


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    srv = ServerProcess(tiny_qwen3_dir, tmp_path_factory.mktemp("edges"), "--num-kv-blocks", "256",
                        "--max-model-len", "2048", "--shutdown-timeout", "30", env={"LADLE_API_KEY": KEY + " \n"})
    srv.headers = {"authorization": f"Bearer {KEY}"}
    yield srv.start()
    srv.kill()


def test_a_key_read_from_a_file_with_its_newline_is_the_key(server):
    ok = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"authorization": f"Bearer {KEY} x"})
    assert_error_envelope(r, 401, "invalid_api_key")


@pytest.mark.parametrize("key", ["", "  \n", "two words", "caf\u00e9"])
def test_a_key_no_client_can_send_is_refused_at_startup(key):
    from ladle.entrypoints.openai.serve_args import _api_key

    with pytest.raises(ValueError, match="--api-key"):
        _api_key(key)


def test_a_body_that_is_not_json_gets_415(server):
    url, auth = server.base_url + "/v1/completions", server.headers
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    r = httpx.post(url, content=body, headers={**auth, "content-type": "text/plain"})
    err = assert_error_envelope(r, 415, "unsupported_media_type")
    assert "application/json" in err["message"]
    r = httpx.post(url, content=gzip.compress(body), headers={**auth, "content-type": "application/json",
                                                              "content-encoding": "gzip"})
    assert "gzip" in assert_error_envelope(r, 415, "unsupported_media_type")["message"]
    r = httpx.post(url, content=body, headers={**auth, "content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_head_health_models_root_and_a_clipped_404(server):
    assert httpx.head(server.base_url + "/health").status_code == 200
    card = httpx.get(server.base_url + "/v1/models", headers=server.headers).json()["data"][0]
    assert card["root"] == card["id"] and "/" not in (card["root"] or "").removeprefix(card["id"])
    r = server.post("/v1/completions", {"model": "m" * 1_000_000, "prompt": "hi"})
    err = assert_error_envelope(r, 404, "model_not_found")
    assert len(err["message"]) < 1000 and "1000000 characters" in err["message"]


def test_clients_see_the_directorys_name_never_its_path(tiny_qwen3_dir, tmp_path):
    """The served name defaults to the checkpoint directory's name; the path as given is still served (vLLM's
    clients send it) but shown nowhere: not in /v1/models, a 404, /metrics, nor the open /health while an engine
    restart fails on a checkpoint that lost its config.json."""
    model = shutil.copytree(tiny_qwen3_dir, tmp_path / "ckpts" / "my-model")
    paths = {str(model), str(model.resolve()), str(tmp_path)}
    srv = ServerProcess(str(model), tmp_path, "--num-kv-blocks", "64").start()
    try:
        card = httpx.get(srv.base_url + "/v1/models").json()["data"][0]
        assert card["id"] == card["root"] == "my-model", card
        assert srv.post("/v1/completions", {"model": str(model), "prompt": "hi", "max_tokens": 2}).status_code == 200
        r = srv.post("/v1/completions", {"model": "other", "prompt": "hi", "max_tokens": 2})
        err = assert_error_envelope(r, 404, "model_not_found")
        assert "'my-model'" in err["message"] and not any(p in r.text for p in paths), err
        assert not any(p in srv.metrics() for p in paths)

        (model / "config.json").rename(model / "config.json.moved")
        os.kill(srv.health()[1]["engine_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "exited with code" not in str((body := httpx.get(srv.base_url + "/health").text)):
            assert time.monotonic() < deadline, body
            time.sleep(0.1)
        assert "<model> has no config.json" in body.replace("'", ""), body
        assert not any(p in body for p in paths), body
        r = srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and not any(p in r.text for p in paths), r.text
        assert f"{model}' has no config.json" in srv.log()  # the operator's log keeps the whole text
    finally:
        srv.kill()


def test_a_taken_port_fails_at_once_in_one_line(server, tiny_qwen3_dir):
    port = server.base_url.rsplit(":", 1)[1]
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "ladle.entrypoints.openai.api_server", "--model", tiny_qwen3_dir,
                          "--port", port], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0] and "in use" in lines[0]
    print(f"\na second server on port {port}: exit {run.returncode} after {took:.2f} s (interpreter start "
          f"included): {lines[0]}")


def test_a_truncated_tokenizer_is_named(tiny_qwen3_dir, tmp_path):
    model = shutil.copytree(tiny_qwen3_dir, tmp_path / "model")
    tok = model / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:5000])
    run = subprocess.run([sys.executable, "-m", "ladle.entrypoints.openai.api_server", "--model", str(model), "--port", "0",
                          "--num-kv-blocks", "64"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert f"{tok} is not valid JSON" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_broken_chat_template_is_the_servers_error(tiny_qwen3_dir, tmp_path):
    model = shutil.copytree(tiny_qwen3_dir, tmp_path / "model")
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")  # never closed
    srv = ServerProcess(str(model), tmp_path, "--num-kv-blocks", "64").start()
    try:
        r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert_error_envelope(r, 500, "chat_template_error")
        assert "the chat template does not parse" in srv.log()
        assert srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        srv.kill()


def test_sighup_drains_like_sigterm(server):
    """Runs last: it stops the module's server."""
    async def run() -> list:
        events: list = []
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, headers=server.headers) as http:
            async def stream() -> None:
                body = {"prompt": "hang up", "max_tokens": 300, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        events.extend(sse_events([line]))
                        started.set()

            task = asyncio.create_task(stream())
            await asyncio.wait_for(started.wait(), 30)
            server.proc.send_signal(signal.SIGHUP)
            await asyncio.wait_for(task, 60)
        return events

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    text = [e for e in events[:-1] if e["choices"]]
    assert text[-1]["choices"][0]["finish_reason"] == "length", events[-3:]
    assert server.proc.wait(30) == 0, server.log()
