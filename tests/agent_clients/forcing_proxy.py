"""A forwarding proxy between an agent CLI and `ladle serve`, for the client tests and the agent session benchmark.
A random-weight model never chooses a tool, so the proxy forces the client's own tools in a scripted order: each
force on the first request after the previous forced one that offers its tool, its arguments pinned to one harmless
value each (a file to read, a command that only reads); the client runs that call and sends its result on the next
request. Pinned by narrowing the tool's parameters in that request (the model writes them), or, where the prompt
must stay as the client wrote it (the session benchmark: a changed tool list would break the prefix cache at that
tool), by writing them into the answer's tool_use block in place of what the model wrote (Anthropic's API). Every other request passes unchanged; the proxy keeps every request body as the client sent
it, each answer's status, when its first event came and the usage its events reported, and streams the answers
through untouched."""
from __future__ import annotations

import copy
import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

# Hop-by-hop headers, and what the proxy sets itself (an identity body it frames anew).
_DROPPED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}


@dataclass(frozen=True)
class Force:
    tool: str
    arguments: dict[str, Any]  # the call's only valid arguments
    in_answer: bool = False  # pinned in the answer (the request's tools untouched), not by narrowing the schema

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": {k: {"const": v} for k, v in self.arguments.items()},
                "required": list(self.arguments), "additionalProperties": False}


@dataclass
class Seen:
    path: str
    body: Any  # as the client sent it
    forced: bool
    status: int = 0
    first_event_s: float | None = None  # seconds from the request to the answer's first server-sent event
    usage: dict[str, Any] = field(default_factory=dict)  # merged from the events that carry usage

    def take(self, line: bytes, elapsed: float) -> None:
        """One line of the answer as it passes: the first event's time, and usage from Anthropic's message_start
        and message_delta, the Responses API's response.completed and a Chat Completions chunk's usage."""
        if not line.startswith(b"data:"):
            return
        try:
            data = json.loads(line[5:])
        except ValueError:
            return  # Chat Completions' [DONE]
        if self.first_event_s is None:
            self.first_event_s = elapsed
        if not isinstance(data, dict):
            return
        found = ((data.get("message") or {}).get("usage") or data.get("usage")
                 or (data.get("response") or {}).get("usage"))
        if isinstance(found, dict):
            self.usage.update(found)


@dataclass
class ForcingProxy:
    upstream: str  # http://host:port of the server
    forces: tuple[Force, ...] = ()  # in the order they are to be forced
    seen: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        """Listens on a free loopback port (in the caller's network namespace); returns its base URL."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                proxy._forward(self)

            do_GET = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def forced(self) -> int | None:
        """The index in seen of the first request whose tool was forced."""
        return next((i for i, s in enumerate(self.seen) if s.forced), None)

    def _forward(self, h: BaseHTTPRequestHandler) -> None:
        raw = h.rfile.read(int(h.headers.get("content-length") or 0))
        began = time.monotonic()
        body = json.loads(raw) if raw else None
        with self._lock:  # each force on one request, the first to offer its tool, even with requests in parallel
            sent, force = self._rewritten(urlsplit(h.path).path, body)
            seen = Seen(h.path, body, force is not None)
            self.seen.append(seen)
        payload = json.dumps(sent).encode() if sent is not None else b""
        up = urlsplit(self.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=600)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _DROPPED}
            conn.request(h.command, h.path, body=payload, headers={**headers, "Content-Length": str(len(payload))})
            resp = conn.getresponse()
            seen.status = resp.status
            h.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _DROPPED:
                    h.send_header(k, v)
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            pin = force.arguments if force is not None and force.in_answer else None
            pending = b""
            while piece := resp.read1(65536):  # as it comes: server-sent events stream through, line by line
                *lines, pending = (pending + piece).split(b"\n")
                for line in lines:
                    seen.take(line, time.monotonic() - began)
                out = b"".join(_pinned(line, pin) + b"\n" for line in lines)
                if out:
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(out), out))
                    h.wfile.flush()
            if pending:  # a stream whose last line has no newline, or a JSON answer
                seen.take(pending, time.monotonic() - began)
                h.wfile.write(b"%x\r\n%s\r\n" % (len(pending), pending))
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; the server sees its end of the stream go too
        finally:
            conn.close()

    def _rewritten(self, path: str, body: Any) -> tuple[Any, Force | None]:
        """The body to send upstream, and the force applied to it."""
        done = sum(s.forced for s in self.seen)
        if done == len(self.forces) or not isinstance(body, dict):
            return body, None
        force = self.forces[done]
        out = copy.deepcopy(body)
        for tool in out.get("tools") or []:
            if _name(tool) == force.tool:
                if not force.in_answer:
                    _narrow(tool, force.schema())
                out["tool_choice"] = _choice(path.rsplit("/v1/", 1)[-1], force.tool)
                return out, force
        return body, None


def _pinned(line: bytes, arguments: dict[str, Any] | None) -> bytes:
    """An Anthropic stream's line, a tool_use block's input replaced by arguments (ladle sends a block's input in
    one input_json_delta, when the block closes)."""
    if arguments is None or not line.startswith(b"data:") or b'"input_json_delta"' not in line:
        return line
    event = json.loads(line[5:])
    event["delta"]["partial_json"] = json.dumps(arguments)
    return b"data: " + json.dumps(event).encode()


def _name(tool: dict[str, Any]) -> str | None:
    return (tool.get("function") or {}).get("name") or tool.get("name")


def _narrow(tool: dict[str, Any], schema: dict[str, Any]) -> None:
    if "input_schema" in tool:
        tool["input_schema"] = schema
    elif "function" in tool:
        tool["function"]["parameters"] = schema
    else:
        tool["parameters"] = schema


def _choice(api: str, name: str) -> dict[str, Any]:
    if api == "messages":
        return {"type": "tool", "name": name}
    if api == "responses":
        return {"type": "function", "name": name}
    return {"type": "function", "function": {"name": name}}
