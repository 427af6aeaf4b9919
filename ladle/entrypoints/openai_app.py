"""The FastAPI app of `ladle serve`: OpenAI routes, /health, /metrics, errors in OpenAI's envelope."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ladle.engine.async_client import AsyncEngineClient, EngineState, EngineUnavailableError
from ladle.entrypoints.metrics import ServerMetrics
from ladle.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from ladle.entrypoints.serving_chat import OpenAIServingChat
from ladle.entrypoints.serving_completion import OpenAIServingCompletion
from ladle.entrypoints.serving_engine import OpenAIError

logger = logging.getLogger("ladle.server")


@dataclass
class ServerState:
    client: AsyncEngineClient
    metrics: ServerMetrics
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    model_name: str
    model_path: str
    health_timeout_s: float = 5.0
    draining: bool = False


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                           code="invalid_json")
    where = ".".join(loc) or "body"
    return OpenAIError(400, f"{where}: {first.get('msg', 'invalid value')}", code="invalid_value",
                       param=loc[0] if loc else None)


class DrainMiddleware:
    """Once SIGTERM arrived, new requests get 503 while the ones in flight finish."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["app"].state.server.draining:
            err = OpenAIError(503, "the server is shutting down", code="server_shutting_down")
            await JSONResponse(err.response().model_dump(), status_code=503)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        yield
        await state.client.shutdown()

    app = FastAPI(title="ladle", summary="OpenAI-compatible server over the ladle engine", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(DrainMiddleware)

    def envelope(err: OpenAIError) -> JSONResponse:
        return JSONResponse(err.response().model_dump(), status_code=err.status)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return envelope(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return envelope(_validation_error(exc))  # OpenAI answers 400, not FastAPI's 422

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return envelope(OpenAIError(exc.status_code, str(exc.detail), code=None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return envelope(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                              code="model_not_found", param="model")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        check_model(request.model)
        return await state.completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        check_model(request.model)
        return await state.chat.create_chat_completion(request, raw_request)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        info = state.client.info
        return ModelList(data=[ModelCard(id=state.model_name, root=state.model_path,
                                         max_model_len=info.max_model_len if info else None)])

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 only when the engine process is up and answers a ping; the body says why when it is not."""
        client = state.client
        body: dict[str, Any] = {"engine_state": client.state.value, "engine_pid": client.engine_pid,
                                "engine_restarts": client.num_restarts, "last_failure": client.failure_reason,
                                "num_requests_in_flight": client.num_in_flight}
        try:
            snap = await client.ping(state.health_timeout_s)
        except EngineUnavailableError as e:
            return JSONResponse({"status": "unhealthy", "reason": str(e), **body}, status_code=503)
        body.update(num_requests_running=snap.num_running, num_requests_waiting=snap.num_waiting,
                    kv_blocks_in_use=snap.kv_blocks_in_use, num_kv_blocks=snap.num_kv_blocks,
                    kv_cache_usage=snap.kv_usage)
        return JSONResponse({"status": "ok", **body})

    @app.get("/metrics")
    async def metrics() -> Response:
        with contextlib.suppress(EngineUnavailableError):
            await state.client.ping(1.0)  # fresh gauges; a busy or dead engine leaves the last ones
        state.metrics.set_engine(state.client.state is EngineState.READY, state.client.num_restarts)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
