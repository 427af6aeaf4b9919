"""What /v1/completions and /v1/chat/completions share: errors, sampling params, and the token stream of one
API request from the engine process, detokenized incrementally on the API side."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ladle.engine.async_client import AsyncEngineClient, EngineDeadError, EngineUnavailableError, RequestHandle
from ladle.engine.core import EngineCoreOutput
from ladle.engine.detokenizer import IncrementalDetokenizer, decode_logprobs
from ladle.entrypoints.metrics import ServerMetrics
from ladle.entrypoints.openai_protocol import ErrorInfo, ErrorResponse, SamplingRequest, UsageInfo
from ladle.outputs import Logprob
from ladle.request import RequestRejected
from ladle.sampling_params import SamplingParams

T = TypeVar("T")

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "service_unavailable_error"}


class OpenAIError(Exception):
    """An error the server answers with OpenAI's envelope."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> ErrorResponse:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code))


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(err: OpenAIError) -> str:
    return sse(err.response().model_dump_json())


SSE_DONE = sse("[DONE]")


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for an OpenAI request; OpenAI's defaults where the client sent null."""
    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    try:
        return SamplingParams(
            n=pick(req.n, 1), temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0),
            top_k=pick(req.top_k, 0), min_p=pick(req.min_p, 0.0), seed=req.seed,
            presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, 1.0), stop=req.stop,
            stop_token_ids=req.stop_token_ids or [], include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as e:
        raise OpenAIError(400, str(e), code="invalid_value") from None


@dataclass
class ChoiceState:
    index: int
    child_id: str
    prompt_index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None


@dataclass
class ChoiceDelta:
    choice: ChoiceState
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]

    @property
    def finish_reason(self) -> str | None:
        return self.choice.finish_reason


class GenerationStream:
    """One API request in the engine: n choices per prompt, each an engine request of its own (a child)."""

    def __init__(self, client: AsyncEngineClient, tokenizer: Any, metrics: ServerMetrics, request_id: str,
                 prompts: list[list[int]], params: SamplingParams) -> None:
        self.client, self.tokenizer, self.metrics = client, tokenizer, metrics
        self.request_id, self.prompts, self.params = request_id, prompts, params
        self.arrival = time.monotonic()
        self.first_token_seen = False
        self.choices: list[ChoiceState] = []
        for p, ids in enumerate(prompts):
            for i in range(params.n):
                index = p * params.n + i
                detok = IncrementalDetokenizer(tokenizer, ids, params.stop, params.include_stop_str_in_output,
                                               params.skip_special_tokens, min_tokens=params.min_tokens)
                self.choices.append(ChoiceState(index, f"{request_id}-{index}", p, detok))
        self._by_child = {c.child_id: c for c in self.choices}
        self._handle: RequestHandle | None = None
        self.finished = False

    async def start(self) -> None:
        """Submit to the engine; raises OpenAIError if it will not take the request."""
        children = [(c.child_id, self.prompts[c.prompt_index], self.params.for_child(c.index % self.params.n))
                    for c in self.choices]
        try:
            self._handle = await self.client.add_request(self.request_id, children)
        except RequestRejected as e:
            raise OpenAIError(429 if e.code == "queue_full" else 400, str(e), code=e.code) from None
        except EngineUnavailableError as e:
            raise OpenAIError(503, str(e), code=e.code) from None
        except EngineDeadError as e:
            raise OpenAIError(503, str(e), code="engine_restarting") from None

    def abort(self, reason: str = "abort") -> None:
        """The client went away (or the response failed): free the engine's KV for the unfinished choices."""
        if not self.finished:
            self.finished = True
            self.client.abort(self.request_id)
            for c in self.choices:
                if c.finish_reason is None:
                    self.metrics.finished(reason)

    @property
    def usage(self) -> UsageInfo:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Yields what each batch of engine outputs added; raises OpenAIError if the engine dies."""
        assert self._handle is not None, "start() first"
        queue = self._handle.queue
        try:
            while any(c.finish_reason is None for c in self.choices):
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                deltas = []
                for item in items:
                    if isinstance(item, EngineDeadError):
                        raise OpenAIError(503, str(item), code="engine_restarting")
                    delta = self._apply(item)
                    if delta is not None:
                        deltas.append(delta)
                if deltas:
                    yield deltas
        except OpenAIError:
            self.abort("error")  # the engine died or failed one choice: stop the others
            raise
        except BaseException:
            self.abort()  # the consumer went away
            raise
        self.finished = True
        self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrival)

    def _apply(self, out: EngineCoreOutput) -> ChoiceDelta | None:
        ch = self._by_child.get(out.request_id)
        if ch is None or ch.finish_reason is not None:
            return None  # e.g. tokens that raced with our abort after a stop string
        if out.finish_reason == "error":
            raise OpenAIError(500, f"the engine failed this request: {out.error}", code="engine_error")
        now = time.monotonic()
        if out.new_token_ids:
            if not self.first_token_seen:
                self.first_token_seen = True
                self.metrics.time_to_first_token.observe(now - self.arrival)
            elif ch.last_token_time is not None:
                self.metrics.inter_token_latency.observe(now - ch.last_token_time)
            ch.last_token_time = now
        new_logprobs = [decode_logprobs(self.tokenizer, lp) for lp in out.new_logprobs] if self.params.logprobs is not None else []
        ch.token_ids.extend(out.new_token_ids)
        ch.logprobs.extend(new_logprobs)
        stop_str = ch.detok.update(out.new_token_ids, stop_terminated=out.finish_reason == "stop")
        if stop_str is not None:
            if out.finish_reason is None:
                self.client.abort(self.request_id, [ch.child_id])  # stop strings are found here, not in the core
            ch.finish_reason, ch.stop_reason = "stop", stop_str
        elif out.finish_reason is not None:
            ch.finish_reason, ch.stop_reason = out.finish_reason, out.stop_reason
        if ch.finish_reason is not None:
            ch.detok.finish()
            self.metrics.finished(ch.finish_reason)
        return ChoiceDelta(ch, ch.detok.text_delta(), list(out.new_token_ids), new_logprobs)


async def run_unless_disconnected(work: Callable[[], Awaitable[T]], raw_request: Request,
                                  on_disconnect: Callable[[], None]) -> T | None:
    """Run a non-streaming request; if the client hangs up first, cancel it and call on_disconnect (which
    aborts the engine requests, freeing their KV blocks). Returns None in that case."""
    async def wait_disconnect() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        on_disconnect()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    on_disconnect()
    return None


async def respond(stream: GenerationStream, events: AsyncIterator[str], collect: Callable[[], Awaitable[Any]],
                  want_stream: bool, raw_request: Request) -> Response:
    """Stream SSE events, or collect the whole response unless the client hangs up first."""
    if want_stream:
        return StreamingResponse(events, media_type="text/event-stream")
    result = await run_unless_disconnected(collect, raw_request, stream.abort)
    if result is None:
        return Response(status_code=499)  # the client hung up; nobody reads this
    return JSONResponse(result.model_dump())
