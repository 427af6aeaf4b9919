"""The server's OpenAPI document, true to what it answers: the status codes each route really returns with
OpenAI's error schema, JSON or SSE for the generation routes, text/plain for /metrics; no 422 (validation
errors are 400 here), and a bearer scheme when an API key is set."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ladle.entrypoints.openai.protocol import ErrorResponse

_ERRORS = {
    400: "invalid request: a malformed body, a value out of range, a prompt too long for the model",
    401: "missing or wrong API key (only when the server has one)",
    404: "the model named in the request is not served here",
    408: "the request body stopped arriving for --timeout-request-body seconds",
    413: "the request body exceeds --max-request-body-bytes",
    415: "the body is not application/json, or is compressed",
    429: "the queue is full (--max-queue-len); retry later",
    500: "an internal error; the message gives an id to find it in the server log",
    503: "no engine can serve now (starting, restarting, failed) or the server is shutting down",
}


# One server-sent event (OpenAPI 3.2's itemSchema for sequential media types; each event is an object).
_SSE_EVENT = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "contentMediaType": "application/json", "description": (
        "a JSON chunk of the completion; an error mid-stream is one event holding the error envelope; the "
        "stream always ends with the event `[DONE]`")}},
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in codes}


def generation_responses(model: type, api_key: bool) -> dict[int | str, dict[str, Any]]:
    """200 as JSON (the whole response) or as server-sent events (stream: true), then the errors."""
    ok = {"model": model, "description": "the completion; with stream: true, server-sent events",
          "content": {"text/event-stream": {"itemSchema": _SSE_EVENT}}}
    return {200: ok, **error_responses(400, *((401,) if api_key else ()), 404, 408, 413, 415, 429, 500, 503)}


METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition format",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
}


def install_openapi(app: FastAPI, api_key: bool) -> None:
    """Replace FastAPI's generated document with one that drops its 422s (and their schemas) and, with an
    API key, declares the bearer scheme on the /v1 routes."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path, operations in doc["paths"].items():
            for op in operations.values():
                op["responses"].pop("422", None)
                if api_key and path.startswith("/v1"):
                    op["security"] = [{"bearer": []}]
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        if api_key:
            doc.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
