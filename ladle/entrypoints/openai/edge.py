"""What every HTTP request passes before the app sees it: the shutdown gate (503), the API key (401), the media
type (415), the body size limit (413) and the body timeout (408), all answered in OpenAI's error envelope. It
also counts the requests in flight, so a shutdown can wait for their responses to be written."""
from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ladle.entrypoints.openai.anthropic.protocol import ANTHROPIC, anthropic_error
from ladle.entrypoints.openai.protocol import OpenAIError, clip

# Routes that stay open without a key and while draining: probes and scrapers must see the truth.
OPEN_PATHS = ("/health", "/metrics")
# How long a refused request may go on sending its body (see refuse()); nginx lingers the same way.
LINGER_TOTAL_S = 10.0
LINGER_IDLE_S = 2.0


@dataclass
class EdgeLimits:
    api_key: str | None = None
    max_request_body_bytes: int = 4 * 2**20
    body_timeout_s: float = 30.0  # the longest gap between two parts of a request body


@dataclass
class EdgeState:
    draining: bool = False
    in_flight: int = 0  # HTTP requests inside the app, streams included


async def refuse(receive: Receive, send: Send, status: int, message: str, code: str,
                 headers: dict[str, str] | None = None, path: str = "") -> None:
    """Answer an error without reading the request, then linger: discard what the client still sends before
    the connection closes. Closing a socket with unread bytes makes the kernel reset it, and a reset can take
    the answer's unsent bytes with it, so the client would see a dropped connection instead of the error.
    The Messages API's routes get Anthropic's error body."""
    body = (json.dumps(anthropic_error(status, message)).encode() if path.startswith(ANTHROPIC) else
            OpenAIError(status, message, code).response().model_dump_json().encode())
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    # The whole answer goes out now (content-length tells the client it is complete); the empty last part
    # after the drain is what lets the server close.
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await _drain(receive)
    await send({"type": "http.response.body", "body": b""})


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of the request body, for at most LINGER_TOTAL_S and while the client keeps
    sending (LINGER_IDLE_S between parts), so a client that never stops cannot hold the connection."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_TOTAL_S
    while (left := deadline - loop.time()) > 0:
        try:
            message = await asyncio.wait_for(receive(), min(left, LINGER_IDLE_S))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, limits: EdgeLimits, state: EdgeState) -> None:
        self.app = app
        self.limits = limits
        self.state = state
        self._key = limits.api_key.encode() if limits.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.state.draining and path not in OPEN_PATHS:
            await refuse(receive, send, 503, "the server is shutting down", "server_shutting_down", path=path)
            return
        if self._key is not None and path.startswith("/v1") and not self._authorized(scope):
            await refuse(receive, send, 401, "a valid API key is required: send the header 'Authorization: "
                         "Bearer <key>' (or 'x-api-key: <key>')", "invalid_api_key", {"WWW-Authenticate": "Bearer"},
                         path)
            return
        if scope["method"] == "POST" and (unsupported := _unsupported_media(scope["headers"])) is not None:
            await refuse(receive, send, 415, unsupported, "unsupported_media_type", path=path)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.state.in_flight -= 1

    def _authorized(self, scope: Scope) -> bool:
        """'Authorization: Bearer KEY', or Anthropic's 'x-api-key: KEY' (its clients send either)."""
        assert self._key is not None
        bearer = x_api_key = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                bearer = value
            elif name == b"x-api-key":
                x_api_key = value
        scheme, _, token = bearer.partition(b" ")
        # compare_digest takes the same time wherever the first difference is: no timing oracle on the key.
        by_bearer = hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"
        return hmac.compare_digest(x_api_key.strip(), self._key) or by_bearer

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413: a declared length over the limit is refused before
        any of it is read, a chunked body as soon as it passes the limit."""
        limit = self.limits.max_request_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._too_large(receive, send, int(value), scope["path"])
                return None
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.limits.body_timeout_s)
            except asyncio.TimeoutError:
                await refuse(receive, send, 408, f"no part of the request body arrived for "
                             f"{self.limits.body_timeout_s:g} s (--timeout-request-body)", "request_timeout",
                             {"Connection": "close"}, scope["path"])
                return None
            if message["type"] != "http.request":
                return None  # the client left before sending its request: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(receive, send, size, scope["path"])
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, receive: Receive, send: Send, size: int, path: str) -> None:
        await refuse(receive, send, 413, f"the request body ({size} bytes or more) exceeds the server's "
                     f"limit of {self.limits.max_request_body_bytes} bytes (--max-request-body-bytes)",
                     "request_too_large", {"Connection": "close"}, path)


def _unsupported_media(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a POST body cannot be read as JSON (None when it can): another media type, or an encoding such as
    gzip (the server decodes none). No Content-Type at all is read as JSON, as FastAPI does."""
    for name, value in headers:
        text = value.decode("latin-1").strip()
        if name == b"content-type":
            media = text.split(";", 1)[0].strip().lower()
            if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
                return f"Content-Type {clip(text)!r} is not supported; send the body as application/json"
        elif name == b"content-encoding" and text.lower() not in ("", "identity"):
            return f"Content-Encoding {clip(text)!r} is not supported; send the body uncompressed"
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body read already, then waits on the real one (for a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
