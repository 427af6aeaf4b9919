"""Runs `python -m ladle.entrypoints.openai.api_server` as a subprocess on a free loopback port, for the server tests.

Every wait is bounded, and stop() escalates from SIGTERM to SIGKILL (engine process included), so a broken
server fails a test instead of hanging CI.
"""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

_LISTENING = re.compile(r"ladle: serving .* on http://127\.0\.0\.1:(\d+)/v1")


class ServerProcess:
    def __init__(self, model_dir: str, log_dir: Path, *flags: str, api_key: str | None = None,
                 command: list[str] | None = None, env: dict[str, str] | None = None,
                 max_open_files: int | None = None) -> None:
        # command: how to start it, e.g. ["ladle", "serve", DIR]; the module with --model by default.
        # env: extra environment (LADLE_API_KEY there overrides api_key's); max_open_files: RLIMIT_NOFILE, soft
        # and hard, as a locked-down host sets it.
        start = command or [sys.executable, "-m", "ladle.entrypoints.openai.api_server", "--model", model_dir]
        self.extra_env = env or {}
        self.max_open_files = max_open_files
        self.cmd = [*start, "--host", "127.0.0.1", "--port", "0", *flags]
        self.log_path = log_dir / f"server-{os.getpid()}-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen | None = None
        self.base_url = ""
        self.api_key = api_key  # given to the server as LADLE_API_KEY, and sent by post()
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def start(self, timeout: float = 90.0, wait_healthy: bool = True) -> "ServerProcess":
        log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("LADLE_API_KEY", None)
        if self.api_key:
            env["LADLE_API_KEY"] = self.api_key
        env.update(self.extra_env)
        limit = self.max_open_files

        def lower_limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, preexec_fn=lower_limit if limit is not None else None)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.base_url:
            m = _LISTENING.search(self.log())
            if m:
                self.base_url = f"http://127.0.0.1:{m.group(1)}"
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server did not start listening:\n{self.log()}")
            else:
                time.sleep(0.1)
        if wait_healthy:
            try:
                self.wait_health(200, deadline - time.monotonic())
            except BaseException:
                self.kill()
                raise
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def health(self) -> tuple[int, dict[str, Any]]:
        r = httpx.get(self.base_url + "/health", timeout=10)
        return r.status_code, r.json()

    def wait_health(self, status: int, timeout: float, **expect: Any) -> dict[str, Any]:
        """Poll /health until it answers `status` (and the body has the `expect` items)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                code, body = self.health()
                last = (code, body)
                if code == status and all(body.get(k) == v for k, v in expect.items()):
                    return body
            except httpx.HTTPError as e:
                last = e
            time.sleep(0.05)
        raise AssertionError(f"/health never answered {status} {expect} in {timeout} s; last: {last}\n{self.log()}")

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=10).text

    def post(self, path: str, body: Any = None, content: bytes | None = None, timeout: float = 60) -> httpx.Response:
        if content is not None:
            return httpx.post(self.base_url + path, content=content, timeout=timeout,
                              headers={"content-type": "application/json", **self.headers})
        return httpx.post(self.base_url + path, json=body, timeout=timeout, headers=self.headers)

    def rss_mib(self) -> float:
        """Resident memory of the API process (not the engine's, nor its supervisor's)."""
        status = Path(f"/proc/{self.api_pid()}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    def engine_pid(self) -> int:
        return self.health()[1]["engine_pid"]

    def api_pid(self) -> int:
        """The API process (self.proc is `ladle serve`'s outer process, which restarts it)."""
        return self.health()[1]["api_pid"]

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL (the engine too) if it does not exit in time; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is None:
            return
        pid = None
        try:
            pid = self.health()[1].get("engine_pid") if self.base_url else None
        except (httpx.HTTPError, json.JSONDecodeError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def sse_events(lines: list[str]) -> list[Any]:
    """The JSON payloads of SSE `data:` lines, with "[DONE]" kept as the string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error_envelope(r: httpx.Response, status: int, code: str | None = None,
                          param: str | None = None) -> dict[str, Any]:
    """The response is OpenAI's error envelope with this status (and code and param, when given)."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


async def stream_events(http: httpx.AsyncClient, body: dict, on_event: Any = None) -> list[Any]:
    """Stream a completion; returns its SSE payloads, calling on_event(events so far) after each."""
    events: list[Any] = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events += sse_events([line])
                if on_event is not None:
                    on_event(events)
    return events


async def stream_tokens(http: httpx.AsyncClient, body: dict, times: list[float],
                         first_token: list[float] | None = None) -> dict:
    """Stream a completion, appending each content chunk's arrival time; returns the last (usage) event."""
    events = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            ev = sse_events([line])[0]
            events.append(ev)
            if isinstance(ev, dict) and ev.get("choices"):
                times.append(now)
                if first_token is not None and not first_token:
                    first_token.append(now)
    assert events[-1] == "[DONE]", events[-3:]
    return events[-2]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of a Prometheus sample whose name starts with name and carries the given labels (0 if none)."""
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def openai_client(server: ServerProcess) -> Any:
    """The official openai client on a test server (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key or "none", max_retries=0)


def served_model(client: Any) -> str:
    return client.models.list().data[0].id


def recorded_client_server(tmp_path_factory: Any, label: str, served_name: str) -> "ServerProcess":
    """A server for an agent client's recorded request: a tool-calling Qwen3 with a 4,096-token vocabulary (the
    recordings come to 10-28K tokens on it) and 32K of context, served under the name the recording asked for."""
    from ladle.testing.tool_checkpoints import build_tool_checkpoint

    model = build_tool_checkpoint(tmp_path_factory.mktemp(f"qwen3_{label}"), "qwen3", seed=2, vocab_size=4096,
                                  max_position_embeddings=32768)
    return ServerProcess(model, tmp_path_factory.mktemp(label), "--max-model-len", "32768",
                         "--served-model-name", served_name).start()
