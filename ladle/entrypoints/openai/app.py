"""The FastAPI app of `ladle serve`: OpenAI routes, /health, /metrics, errors in OpenAI's envelope."""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ladle.entrypoints.openai.anthropic.protocol import (
    ANTHROPIC,
    AnthropicMessageResponse,
    CountTokensRequest,
    MessagesRequest,
    TokenCount,
    anthropic_error,
)
from ladle.entrypoints.openai.anthropic.serving import AnthropicServingMessages
from ladle.entrypoints.openai.api_supervisor import api_restarts
from ladle.entrypoints.openai.chat.serving import OpenAIServingChat
from ladle.entrypoints.openai.completions.serving import OpenAIServingCompletion
from ladle.entrypoints.openai.edge import EdgeLimits, EdgeMiddleware, EdgeState
from ladle.entrypoints.openai.field_policy import no_op_fields, query_no_ops
from ladle.entrypoints.openai.openapi_doc import (
    METRICS_RESPONSES,
    error_responses,
    generation_responses,
    install_openapi,
)
from ladle.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    clip,
    internal_error,
)
from ladle.entrypoints.openai.responses.protocol import ResponseObject, ResponsesRequest
from ladle.entrypoints.openai.responses.serving import OpenAIServingResponses
from ladle.entrypoints.openai.serving_engine import ServingContext
from ladle.serving.async_client import AsyncEngineClient, EngineState, EngineUnavailableError

logger = logging.getLogger("ladle.server")
BUSY_AFTER_S = 1.0  # a step running longer is reported as "busy" (still 200: the engine is working)


@dataclass
class ServerState:
    ctx: ServingContext
    edge_limits: EdgeLimits = field(default_factory=EdgeLimits)
    edge: EdgeState = field(default_factory=EdgeState)
    health_timeout_s: float = 5.0

    @property
    def client(self) -> AsyncEngineClient:
        return self.ctx.client

    @property
    def draining(self) -> bool:
        return self.edge.draining


def _field_path(loc: tuple) -> list[str]:
    """The loc of a pydantic error without its union-member tags ('list[constrained-int]', 'str', ...)."""
    return [str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in ("body", "str", "int"))]


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """One 400 naming the field. Of a union's errors, a broken constraint says more than a wrong type, and
    the deepest says most; when every member only had the wrong type, say all of them."""
    errors = list(exc.errors()) or [{}]
    if errors[0].get("type") == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}",
                           code="invalid_json")
    first = max(errors, key=lambda e: (not str(e.get("type", "")).endswith("_type"),
                                       len(_field_path(e.get("loc", ())))))
    path = _field_path(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        msg = "this server does not serve this field (it would not be honoured); leave it out"
        return OpenAIError(400, f"{'.'.join(path)}: {msg}", code="unsupported_parameter",
                           param=path[0] if path else None)
    if str(first.get("type", "")).endswith("_type"):
        same = [e for e in errors if _field_path(e.get("loc", ())) == path]
        msg = " or ".join(dict.fromkeys(str(e.get("msg")) for e in same))
    return OpenAIError(400, f"{'.'.join(path) or 'body'}: {msg}", code="invalid_value",
                       param=path[0] if path else None)


def build_app(state: ServerState) -> FastAPI:
    ctx = state.ctx

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.client.start()
        yield
        await ctx.client.shutdown()
        ctx.pool.shutdown()
        ctx.grammars.shutdown()

    app = FastAPI(title="ladle", summary="OpenAI-compatible server over the ladle engine", lifespan=lifespan)
    app.add_middleware(EdgeMiddleware, limits=state.edge_limits, state=state.edge)
    keyed = state.edge_limits.api_key is not None
    install_openapi(app, api_key=keyed)

    def envelope(err: OpenAIError, headers: Mapping[str, str] | None = None, path: str = "") -> JSONResponse:
        """OpenAI's error body, or Anthropic's on the Messages API's routes."""
        body = anthropic_error(err.status, err.message) if path.startswith(ANTHROPIC) else err.response().model_dump()
        return JSONResponse(body, status_code=err.status, headers=headers)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return envelope(exc, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return envelope(_validation_error(exc), path=request.url.path)  # 400, not FastAPI's 422

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # exc.headers carries e.g. the Allow header of a 405.
        return envelope(OpenAIError(exc.status_code, str(exc.detail), code=None), exc.headers, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return envelope(internal_error(f"{request.method} {request.url.path} failed", exc), path=request.url.path)

    def check_model(name: str | None) -> None:
        # The checkpoint's path as given is served too (vLLM serves under it, so its clients and `vllm bench
        # serve --model DIR` send it), but never shown: the 404 and /v1/models name the served name only.
        if name is not None and name != ctx.model_name and name != ctx.client.model_path:
            raise OpenAIError(404, f"the model {clip(name)!r} does not exist; this server serves "
                              f"{ctx.model_name!r}", code="model_not_found", param="model")

    def check(request: BaseModel, api: str, raw_request: Request) -> None:
        """The model it names is served; the no-op fields and query parameters it sets are counted, and any other
        query parameter refused (field_policy)."""
        check_model(getattr(request, "model", None))
        ctx.metrics.no_ops(api, no_op_fields(api, request) + query_no_ops(api, raw_request.query_params))

    completion, chat = OpenAIServingCompletion(ctx), OpenAIServingChat(ctx)
    messages, responses = AnthropicServingMessages(chat), OpenAIServingResponses(chat)

    @app.post("/v1/completions", response_model=None, responses=generation_responses(CompletionResponse, keyed))
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        check(request, "completions", raw_request)
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions", response_model=None,
              responses=generation_responses(ChatCompletionResponse, keyed))
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        check(request, "chat_completions", raw_request)
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/messages", response_model=None, responses=generation_responses(AnthropicMessageResponse, keyed))
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        """The Anthropic Messages API (errors in Anthropic's envelope)."""
        check(request, "messages", raw_request)
        return await messages.create_message(request, raw_request)

    @app.post("/v1/messages/count_tokens", responses=error_responses(400, *((401,) if keyed else ()), 404, 503))
    async def count_tokens(request: CountTokensRequest, raw_request: Request) -> TokenCount:
        check_model(request.model)
        query_no_ops("messages", raw_request.query_params)  # refused as on /v1/messages; counted there only
        return TokenCount(**await messages.count_tokens(request, raw_request))

    @app.post("/v1/responses", response_model=None, responses=generation_responses(ResponseObject, keyed))
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        """The OpenAI Responses API, stateless."""
        check(request, "responses", raw_request)
        return await responses.create_response(request, raw_request)

    @app.get("/v1/models", responses=error_responses(*((401,) if keyed else ()), 500, 503))
    async def list_models() -> ModelList:
        info = ctx.client.info
        # root is the served name, not the checkpoint's path: clients need no view of the server's disk.
        return ModelList(data=[ModelCard(id=ctx.model_name, root=ctx.model_name,
                                         max_model_len=info.max_model_len if info else None)])

    @app.api_route("/health", methods=["GET", "HEAD"], response_model=HealthResponse,
                   responses={503: {"model": HealthResponse, "description": "unhealthy or draining; the body says "
                                                                            "why"}})
    async def health() -> JSONResponse:
        """200 when the engine process is up and answers a ping (status "busy" while one long step runs);
        503 with the reason when it is not."""
        client = ctx.client
        body = HealthResponse(status="ok", engine_state=client.state.value, api_pid=os.getpid(),
                              api_restarts=api_restarts(), engine_pid=client.engine_pid,
                              engine_restarts=client.num_restarts, last_failure=client.failure_reason,
                              num_requests_in_flight=client.num_in_flight)
        if state.draining:
            body.status, body.reason = "draining", "the server is shutting down"
            return JSONResponse(body.model_dump(), status_code=503)
        try:
            snap = await client.ping(state.health_timeout_s)
        except EngineUnavailableError as e:
            body.status, body.reason = "unhealthy", str(e)
            return JSONResponse(body.model_dump(), status_code=503)
        body.num_requests_running, body.num_requests_waiting = snap.num_running, snap.num_waiting
        body.kv_blocks_in_use, body.num_kv_blocks = snap.kv_blocks_in_use, snap.num_kv_blocks
        body.kv_cache_usage, body.step_running_s = snap.kv_usage, round(snap.step_running_s, 3)
        if snap.step_running_s >= BUSY_AFTER_S:
            body.status, body.reason = "busy", f"one engine step has run for {snap.step_running_s:.1f} s"
        return JSONResponse(body.model_dump())

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        with contextlib.suppress(EngineUnavailableError):
            await ctx.client.ping(1.0)  # fresh gauges; a busy or dead engine leaves the last ones
        ctx.metrics.set_engine(ctx.client.state is EngineState.READY, ctx.client.num_restarts)
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
