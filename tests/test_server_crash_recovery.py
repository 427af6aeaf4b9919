"""No request can take the server down: the hostile corpus's schema bombs through every API are answered (400 or
200) and the server keeps serving; and when the API process dies anyway (SIGSEGV, SIGKILL), `ladle serve`'s
outer process starts a new one on the same socket, which adopts the engine the dead one left, and new requests
are served again within seconds."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from ladle.testing.tool_checkpoints import build_tool_checkpoint
from server_harness import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _names(n: int) -> dict:
    return {"type": "object", "required": [f"r{i:06d}" for i in range(n)]}


def _bodies(schema: dict, model: str) -> list[tuple[str, dict]]:
    """The schema through each path that compiles a client's schema: response_format, a forced tool call's
    parameters (chat), text.format (Responses), a forced tool's input_schema (Messages)."""
    user = [{"role": "user", "content": "x"}]
    return [(path, {"model": model, **body}) for path, body in [
        ("/v1/chat/completions", {"messages": user, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        ("/v1/chat/completions", {"messages": user, "max_tokens": 8, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": schema}}]}),
        ("/v1/responses", {"input": "x", "max_output_tokens": 8, "text": {"format": {
            "type": "json_schema", "name": "x", "schema": schema}}}),
        ("/v1/messages", {"messages": user, "max_tokens": 8, "tool_choice": {"type": "any"},
                          "tools": [{"name": "f", "input_schema": schema}]}),
    ]]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tool_checkpoint(tmp_path_factory.mktemp("qwen3_tools"), "qwen3", seed=2)
    srv = ServerProcess(model, tmp_path_factory.mktemp("crash"), "--max-model-len", "2048").start()
    yield srv
    srv.stop()


def test_schema_bombs_through_every_api_are_answered_and_the_server_keeps_serving(server):
    answered = []
    model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for n in (30_000, 100_000):
        for path, body in _bodies(_names(n), model):
            start = time.monotonic()
            r = server.post(path, body, timeout=60)
            took = time.monotonic() - start
            answered.append((path, n, r.status_code, round(took, 2)))
            assert r.status_code in (200, 400), (path, n, r.status_code, r.text[:300])
            if r.status_code == 400:
                assert "at most 1024" in r.text, r.text[:300]  # the bound is named
            assert server.health()[0] == 200
    api_pid = server.api_pid()
    for path, body in _bodies({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, model):
        r = server.post(path, body, timeout=60)
        assert r.status_code == 200, (path, r.text[:300])
    assert server.api_pid() == api_pid and server.health()[1]["api_restarts"] == 0
    print(f"\nschema bombs: {answered}")


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL])
def test_a_dead_api_process_is_replaced_on_the_same_socket(server, sig):
    before = server.health()[1]
    model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    os.kill(before["api_pid"], sig)
    start = time.monotonic()
    served = None
    while time.monotonic() - start < 120:
        try:
            r = server.post("/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 4}, timeout=10)
            if r.status_code == 200:
                served = time.monotonic() - start
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert served is not None, server.log()[-3000:]
    after = server.health()[1]
    assert after["api_pid"] != before["api_pid"] and after["api_restarts"] == before["api_restarts"] + 1
    assert after["engine_pid"] == before["engine_pid"] and _alive(before["engine_pid"])  # adopted, not reloaded
    assert f"adopting engine process {before['engine_pid']}" in server.log()
    assert f"the API process died ({sig.name})" in server.log()
    print(f"\n{sig.name}: served again after {served:.2f} s")
