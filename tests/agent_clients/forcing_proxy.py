"""A forwarding proxy between an agent CLI and `ladle serve`, for the client tests. A random-weight model never
chooses a tool, so the proxy forces one of the client's own tools on the first request that offers it, its
parameters narrowed to one harmless value each (a file to read, a command that only reads): the client runs that
call and sends its result on the next request. Every other request passes unchanged; the proxy keeps every request
body as the client sent it, and each answer's status, and streams the answers through untouched."""
from __future__ import annotations

import copy
import http.client
import json
import threading
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

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": {k: {"const": v} for k, v in self.arguments.items()},
                "required": list(self.arguments), "additionalProperties": False}


@dataclass
class Seen:
    path: str
    body: Any  # as the client sent it
    forced: bool
    status: int = 0


@dataclass
class ForcingProxy:
    upstream: str  # http://host:port of the server
    force: Force | None = None
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
        """The index in seen of the request whose tool was forced."""
        return next((i for i, s in enumerate(self.seen) if s.forced), None)

    def _forward(self, h: BaseHTTPRequestHandler) -> None:
        raw = h.rfile.read(int(h.headers.get("content-length") or 0))
        body = json.loads(raw) if raw else None
        with self._lock:  # one forced request, the first to offer the tool, even with requests in parallel
            sent, forced = self._rewritten(urlsplit(h.path).path, body)
            seen = Seen(h.path, body, forced)
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
            while piece := resp.read1(65536):  # as it comes: server-sent events stream through
                h.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                h.wfile.flush()
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; the server sees its end of the stream go too
        finally:
            conn.close()

    def _rewritten(self, path: str, body: Any) -> tuple[Any, bool]:
        """The body to send upstream, and whether its tool was forced."""
        if self.force is None or not isinstance(body, dict) or any(s.forced for s in self.seen):
            return body, False
        out = copy.deepcopy(body)
        for tool in out.get("tools") or []:
            if _name(tool) == self.force.tool:
                _narrow(tool, self.force.schema())
                out["tool_choice"] = _choice(path.rsplit("/v1/", 1)[-1], self.force.tool)
                return out, True
        return body, False


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
