"""uvicorn's httptools protocol, with what it lacks against idle and slow clients.

uvicorn times out only keep-alive gaps: a connection that never sends a byte, or sends its head a byte every
few seconds (slowloris), stays open forever, and each one holds a file descriptor. 1,100 of them exhausted
the open-file limit, and the engine process could then not be restarted. So:
- a request head must arrive whole within `head_timeout_s` of the connection opening (or of the first byte
  of the next request on a keep-alive connection), else the connection is closed (408 if part of it came);
- past `max_connections` open connections a new one is answered 503 and closed, so descriptors stay for
  the engine, its pipes and files;
- a response whose bytes the client has not taken for `stall_timeout_s` (the write buffer stayed above its
  high-water mark that long) is aborted: the app sees a disconnect and aborts the request, freeing its KV.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REFUSAL_LINGER_S = 1.0  # how long a refused connection's request bytes are read and dropped (see edge.refuse)
# Open files kept free of connections: the engine process's pipes on a restart, the tokenizer, logs, /proc.
RESERVED_FILES = 128


@dataclass
class HttpGuard:
    """The limits, and what to call when one of them ends a connection (the server's counters)."""
    head_timeout_s: float = 10.0
    max_connections: int = 1024
    stall_timeout_s: float = 30.0
    on_head_timeout: Callable[[], None] = field(default=lambda: None)
    on_refused: Callable[[], None] = field(default=lambda: None)
    on_stall: Callable[[], None] = field(default=lambda: None)

    def refusal(self) -> bytes:
        body = json.dumps({"error": {
            "message": f"the server has {self.max_connections} connections open, its limit (--max-connections); "
                       "retry shortly", "type": "service_unavailable_error", "param": None,
            "code": "too_many_connections"}}).encode()
        return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


def http_guard(args: argparse.Namespace) -> tuple[HttpGuard, str]:
    """The guard from the flags, and a line saying where max_connections came from. The soft open-file limit
    is raised to the hard one first (as vLLM does): 1024 is a common soft default, far below what a server
    with streams held open needs."""
    for name in ("--timeout-request-head", "--timeout-keep-alive", "--stream-stall-timeout"):
        value = getattr(args, name[2:].replace("-", "_"))
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    fits = soft - RESERVED_FILES
    if fits < 1:
        raise ValueError(f"the open-file limit ({soft}) leaves no room for connections; raise it (ulimit -n) "
                         f"above {RESERVED_FILES}")
    cap = args.max_connections
    if cap is None:
        cap, how = fits, f"derived: open-file limit {soft} less {RESERVED_FILES} kept for the engine and files"
    elif not 1 <= cap <= fits:
        raise ValueError(f"--max-connections={cap} does not fit: the open-file limit is {soft} and "
                         f"{RESERVED_FILES} are kept for the engine and files, so at most {fits}")
    else:
        how = "explicit"
    guard = HttpGuard(args.timeout_request_head, cap, args.stream_stall_timeout)
    return guard, f"max_connections {cap} ({how})"


class GuardedConfig(uvicorn.Config):
    """uvicorn's Config carrying the guard, which every connection's protocol reads."""

    def __init__(self, app: Any, guard: HttpGuard, **kwargs: Any) -> None:
        super().__init__(app, http=GuardedHttpProtocol, **kwargs)
        self.guard = guard


_HEAD_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")


class GuardedHttpProtocol(HttpToolsProtocol):
    def __init__(self, config: GuardedConfig, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = config.guard
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # some bytes of the current request head arrived
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.guard.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._arm_head_timer()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 at once, then read and drop what the client sends for a moment before closing, so the
        answer is not lost to a reset (a socket closed with unread bytes resets the connection)."""
        self._refused = True
        self.transport = transport
        self.guard.on_refused()
        transport.write(self.guard.refusal())
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._refused:
            self.transport.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        if not self._refused:
            super().connection_lost(exc)

    # ---- the request head ----
    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.guard.head_timeout_s, self._head_timed_out)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True
        self._arm_head_timer()  # a keep-alive connection's next request: its own deadline

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_started = False
        super().on_headers_complete()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        self.guard.on_head_timeout()
        if self._head_started:
            self.transport.write(_HEAD_TIMEOUT)
        self.transport.close()

    # ---- the response ----
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.guard.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        if self.transport.is_closing():
            return
        self.guard.on_stall()
        self.transport.abort()  # drops the unsent bytes; connection_lost tells the app the client is gone
