"""`ladle serve-replicas`: two ladle replicas behind one OpenAI endpoint on a local, loopback-only Ray
instance. Both replicas answer (each has its own engine process), completions work through Ray's proxy and the
session router, a session's turns land on one replica (streamed ones too), and SIGTERM leaves no engine behind."""
from __future__ import annotations

import contextlib
import itertools
import json
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


class Replicas:
    """`ladle serve-replicas` with two replicas (session routing, the default) on a local loopback Ray."""

    def __init__(self, model: str, tmp_path: Path) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "replicas.log"
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-m", "ladle.entrypoints.cli", "serve-replicas", model,
                                      "--num-replicas", "2", "--host", "127.0.0.1", "--port", str(self.port),
                                      "--max-model-len", "512", "--num-kv-blocks", "128"],
                                     stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)
        self.pids: set[int] = set()
        self.code: int | None = None
        deadline = time.monotonic() + 240
        with httpx.Client(base_url=self.base, timeout=10) as http:
            while len(self.pids) < 2:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(self.log_path.read_text()[-3000:])
                try:
                    r = http.get("/health")
                    if r.status_code == 200:
                        self.pids.add(r.json()["engine_pid"])
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)

    def stop(self) -> int | None:
        if self.code is not None or self.proc.returncode is not None:
            return self.code
        self.proc.send_signal(signal.SIGTERM)  # the launcher shuts Serve and Ray down in order
        try:
            self.code = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return self.code


@pytest.fixture(scope="module")
def replicas(tiny_qwen3_dir, tmp_path_factory):
    r = Replicas(tiny_qwen3_dir, tmp_path_factory.mktemp("replicas"))
    yield r
    r.stop()


def test_two_replicas_serve_one_endpoint(replicas):
    with httpx.Client(base_url=replicas.base, timeout=60) as http:
        for i in range(4):
            r = http.post("/v1/completions", json={"prompt": f"replica test {i}", "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


SYSTEM = "You are a careful coding agent. Read the files, run the tests, and fix what fails. " * 3


def _chat_turns(http: httpx.Client, session: str, turns: int, how: str) -> list[tuple[str, int, int]]:
    """(replica, prompt tokens, cached tokens) of each turn of a growing conversation keyed the way `how` says."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"session {session}, tool result {t}: " + "ok " * 12})
        body: dict = {"messages": messages, "max_tokens": 4, "ignore_eos": True}
        headers = {}
        if how == "prompt_cache_key":
            body["prompt_cache_key"] = session
        else:
            headers["x-session-affinity"] = session
        if how == "stream":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            events, times, text = [], [], ""
            with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                replica = r.headers["x-ladle-replica"]
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        times.append(time.monotonic())
            assert events[-1] == "[DONE]" and len(events) >= 4  # role, tokens..., usage, [DONE]: one event each
            chunks = [json.loads(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            usage = chunks[-1]["usage"]
        else:
            r = http.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            replica, usage = r.headers["x-ladle-replica"], r.json()["usage"]
            text = r.json()["choices"][0]["message"]["content"]
        out.append((replica, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
        messages.append({"role": "assistant", "content": text})
    return out


def test_a_sessions_turns_land_on_one_replica(replicas):
    """Four sessions keyed by prompt_cache_key, one by x-session-affinity streaming, one by Anthropic's
    metadata.user_id: each stays on the replica that served its first turn, new sessions spread over both, and
    every later turn finds its history cached there."""
    with httpx.Client(base_url=replicas.base, timeout=60) as http:
        runs = {f"s{i}": _chat_turns(http, f"s{i}", 3, "prompt_cache_key") for i in range(4)}
        runs["streamed"] = _chat_turns(http, "streamed", 3, "stream")
        home: set[str] = set()
        messages: list[dict] = []
        model = http.get("/v1/models").json()["data"][0]["id"]
        for t in range(3):
            messages.append({"role": "user", "content": f"anthropic turn {t}: " + "ok " * 12})
            r = http.post("/v1/messages", json={"model": model, "max_tokens": 4, "messages": messages, "system": SYSTEM,
                                                "metadata": {"user_id": "claude-session"}})
            assert r.status_code == 200, r.text
            home.add(r.headers["x-ladle-replica"])
            messages.append({"role": "assistant", "content": r.json()["content"][0]["text"] or "ok"})
        assert len(home) == 1
    for session, turns in runs.items():
        assert len({replica for replica, _, _ in turns}) == 1, (session, turns)
        for (_, before, _), (_, _, cached) in itertools.pairwise(turns):
            assert cached >= before - 32, (session, turns)  # the previous turn's prompt, less its partial last block
    assert len({turns[0][0] for turns in runs.values()}) == 2  # the sessions spread over both replicas


def _aborted(http: httpx.Client, key: str) -> float:
    """Choices the engine of key's replica ended because their client left (its /metrics, reached by the key)."""
    text = http.get("/metrics", headers={"x-session-affinity": key}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ladle:request_success_total{") and 'finished_reason="abort"' in line)


def test_a_client_that_leaves_mid_stream_aborts_its_request(replicas):
    with httpx.Client(base_url=replicas.base, timeout=60) as http:
        before = _aborted(http, "leaver")
        body = {"prompt": "leave early", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body, headers={"x-session-affinity": "leaver"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 30
        while _aborted(http, "leaver") == before:
            assert time.monotonic() < deadline, "the replica's engine did not abort the request of a client that left"
            time.sleep(0.2)


def test_sigterm_leaves_no_engine(replicas):
    code = replicas.stop()
    assert code == 0, replicas.log_path.read_text()[-3000:]
    deadline = time.monotonic() + 30
    while any(map(_alive, replicas.pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, replicas.pids)), "an engine process outlived serve-replicas"
