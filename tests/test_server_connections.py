"""Clients that hold connections without using them: silent sockets and slowloris heads are closed within
--timeout-request-head, connections past --max-connections get 503 at once, a stalled body gets 408, a client
that stops reading its stream is cut off after --stream-stall-timeout (its KV freed), and an engine killed
while every connection slot is held restarts at once (the slots leave files for it).

One server serves this module, under an open-file limit of 256 as a locked-down host has; its tests run in
file order.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest

from server_harness import ServerProcess, metric

pytestmark = [pytest.mark.server, pytest.mark.slow]

HEAD_TIMEOUT = 2.0
MAX_CONNECTIONS = 64
STALL_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    srv = ServerProcess(tiny_qwen3_dir, tmp_path_factory.mktemp("connections"), "--num-kv-blocks", "512",
                        "--max-model-len", "2048", "--timeout-request-head", str(HEAD_TIMEOUT),
                        "--max-connections", str(MAX_CONNECTIONS), "--stream-stall-timeout", str(STALL_TIMEOUT),
                        "--timeout-request-body", "1", max_open_files=256).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def read_all(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (monotonic)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic()


def slow_reader(server: ServerProcess, body: dict) -> socket.socket:
    """A socket that asked for an 8-choice stream with logprobs and reads nothing yet; its small receive buffer
    fills soon, so the server's writes back up."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address(server))
    raw = json.dumps({**body, "n": 8, "ignore_eos": True, "stream": True, "logprobs": 5}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw))
    return sock


class HealthProbe:
    """Polls /health every 50 ms, recording each answer's status and latency."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.latencies, self.statuses = server, [], []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.server.base_url, timeout=10) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                r = await http.get("/health")
                self.latencies.append(time.monotonic() - t0)
                self.statuses.append(r.status_code)
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()


def test_silent_sockets_past_the_cap_get_503_and_the_rest_are_closed_at_the_head_timeout(server):
    before = server.metrics()
    socks = [socket.create_connection(address(server), timeout=10) for _ in range(MAX_CONNECTIONS + 16)]
    opened = time.monotonic()
    answers = [read_all(s, HEAD_TIMEOUT + 10) for s in socks]
    refused = [data for data, _ in answers if data.startswith(b"HTTP/1.1 503 ")]
    closed_silently = [(data, at) for data, at in answers if not data]
    assert len(refused) == 16 and len(closed_silently) == MAX_CONNECTIONS, [a[0][:40] for a in answers]
    assert json.loads(refused[0].partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
    slowest = max(at for _, at in closed_silently) - opened
    assert slowest < HEAD_TIMEOUT + 1.5, f"silent sockets closed {slowest:.1f} s after they opened"
    for s in socks:
        s.close()
    after = server.metrics()

    def increase(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert increase("ladle:http_connections_refused_total") == 16
    assert increase("ladle:http_request_head_timeouts_total") == MAX_CONNECTIONS
    assert server.health()[0] == 200
    print(f"\n{MAX_CONNECTIONS + 16} silent sockets: 16 answered 503 at once, {MAX_CONNECTIONS} closed "
          f"{slowest:.2f} s after opening (head timeout {HEAD_TIMEOUT:g} s)")


def test_a_slowloris_head_is_cut_off_with_408(server):
    socks = [socket.create_connection(address(server), timeout=10) for _ in range(8)]
    opened = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100
    sent = 0
    closed_at = None
    while closed_at is None and sent < len(head):
        for s in socks:
            try:
                s.sendall(head[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
        sent += 1
        time.sleep(0.2)
    answers = [read_all(s, 10)[0] for s in socks]
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers
    assert time.monotonic() - opened < HEAD_TIMEOUT + 2
    for s in socks:
        s.close()


def test_a_body_that_stops_arriving_gets_408(server):
    with socket.create_connection(address(server), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"prompt\": ")
        data, _ = read_all(s, 10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_stream_whose_client_stops_reading_is_aborted_and_health_stays_fast(server):
    before, rss_before = server.metrics(), server.rss_mib()
    sock = slow_reader(server, {"prompt": "never read", "max_tokens": 1800})
    probe = HealthProbe(server)

    async def watch() -> None:
        task = asyncio.create_task(probe.run())
        deadline = time.monotonic() + 60
        while metric(server.metrics(), "ladle:http_stalled_responses_total") == \
                metric(before, "ladle:http_stalled_responses_total"):
            assert time.monotonic() < deadline, "the stalled stream was never aborted"
            await asyncio.sleep(0.2)
        probe.stop()
        await task

    asyncio.run(watch())
    health = server.wait_health(200, 10, num_requests_running=0, kv_blocks_in_use=0)
    assert health["num_requests_in_flight"] == 0
    after = server.metrics()
    aborted = metric(after, "ladle:request_success_total", finished_reason="abort") - \
        metric(before, "ladle:request_success_total", finished_reason="abort")
    generated = metric(after, "ladle:generation_tokens_total") - metric(before, "ladle:generation_tokens_total")
    assert aborted == 8 and generated < 8 * 1800, (aborted, generated)
    sock.close()
    worst = max(probe.latencies)
    assert worst < 1.0 and set(probe.statuses) == {200}, (worst, set(probe.statuses))
    print(f"\nstalled stream: aborted after {generated:.0f} of {8 * 1800} tokens; /health worst {worst * 1000:.0f} ms "
          f"over {len(probe.latencies)} probes; API RSS {rss_before:.0f} -> {server.rss_mib():.0f} MiB")


def test_a_client_that_pauses_and_resumes_gets_everything_while_health_stays_fast(server):
    """A pause shorter than the stall timeout: the backlog it leaves is worked off in slices."""
    before, rss_before = server.metrics(), server.rss_mib()
    sock = slow_reader(server, {"prompt": "pause", "max_tokens": 600})
    probe = HealthProbe(server)

    async def pause_then_read() -> bytes:
        task = asyncio.create_task(probe.run())
        await asyncio.sleep(STALL_TIMEOUT * 0.75)
        data = await asyncio.to_thread(read_all, sock, 60)
        probe.stop()
        await task
        return data[0]

    data = asyncio.run(pause_then_read())
    sock.close()
    events = [line for line in data.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]", events[-2:]
    finished = [json.loads(e[6:]) for e in events[:-1]]
    assert sum(1 for e in finished for c in e["choices"] if c["finish_reason"] == "length") == 8
    assert metric(server.metrics(), "ladle:http_stalled_responses_total") == \
        metric(before, "ladle:http_stalled_responses_total")
    worst = max(probe.latencies)
    assert worst < 1.0 and set(probe.statuses) == {200}, (worst, set(probe.statuses))
    print(f"\nclient paused {STALL_TIMEOUT * 0.75:g} s then read 8 x 600 tokens ({len(data) >> 10} KiB): /health "
          f"worst {worst * 1000:.0f} ms; API RSS {rss_before:.0f} -> {server.rss_mib():.0f} MiB")


def test_an_engine_killed_while_every_connection_is_held_restarts_at_once(server):
    old_pid = server.engine_pid()
    socks = [socket.create_connection(address(server), timeout=10) for _ in range(MAX_CONNECTIONS + 100)]
    os.kill(old_pid, signal.SIGKILL)
    # Every slot is held (and 100 more were refused); the open-file limit still leaves the restart its pipes.
    for s in socks:
        read_all(s, HEAD_TIMEOUT + 10)
        s.close()
    body = server.wait_health(200, 60)
    assert body["engine_pid"] != old_pid and body["engine_restarts"] == 1, body
    assert "Too many open files" not in server.log()
    ok = server.post("/v1/completions", {"prompt": "after the restart", "max_tokens": 4, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
