"""What /v1/completions and /v1/chat/completions share: errors, sampling params, and the token stream of one
API request from the engine process, detokenized incrementally on the API side."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ladle.engine.async_client import AsyncEngineClient, EngineDeadError, EngineUnavailableError, RequestHandle
from ladle.engine.core_output import EngineCoreOutput
from ladle.engine.detokenizer import IncrementalDetokenizer, decode_logprobs
from ladle.entrypoints.metrics import ServerMetrics
from ladle.entrypoints.openai_protocol import OpenAIError, SamplingRequest, UsageInfo
from ladle.entrypoints.tokenizer_pool import TokenizerPool
from ladle.outputs import Logprob
from ladle.request import RequestRejected
from ladle.sampling_params import InvalidSamplingParam, SamplingParams

T = TypeVar("T")
logger = logging.getLogger("ladle.server")


@dataclass(frozen=True)
class ServingLimits:
    """How much one API request may ask for (each choice is an engine request of its own)."""
    max_prompts_per_request: int = 256
    max_choices_per_request: int = 512  # prompts x n


@dataclass
class ServingContext:
    """What both OpenAI endpoints work with."""
    client: AsyncEngineClient
    tokenizer: Any  # decoding, on the event loop
    pool: TokenizerPool  # encoding and chat templates, off it
    metrics: ServerMetrics
    model_name: str
    limits: ServingLimits = field(default_factory=ServingLimits)

    def vocab_size(self) -> int:
        """The served model's vocabulary size; 503 while no engine is ready (no point tokenizing then)."""
        info = self.client.info
        if info is None:
            err = self.client.unavailable_error()
            raise OpenAIError(503, str(err), code=err.code)
        return info.vocab_size

    def check_prompt_length(self, num_tokens: int, param: str) -> None:
        """A prompt longer than the context is refused here, so millions of token ids never cross to the
        engine (which checks prompt + max_tokens exactly)."""
        info = self.client.info
        if info is not None and num_tokens >= info.max_model_len:
            raise OpenAIError(400, f"prompt ({num_tokens} tokens) leaves no room to generate within "
                              f"max_model_len={info.max_model_len}; shorten the prompt",
                              code="context_length_exceeded", param=param)

    def check_choices(self, num_prompts: int, n: int | None) -> None:
        choices = num_prompts * (n or 1)
        if choices > self.limits.max_choices_per_request:
            raise OpenAIError(400, f"{num_prompts} prompt(s) x n={n or 1} asks for {choices} choices; this server "
                              f"allows at most {self.limits.max_choices_per_request} per request "
                              "(--max-choices-per-request)", code="invalid_value", param="n")


def internal_error(what: str, error: BaseException) -> OpenAIError:
    """A 500 that names no exception text: that goes to the log, under an id the client can quote."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    logger.error("%s (error id %s)", what, error_id, exc_info=error)
    return OpenAIError(500, f"internal server error; the server log has the details under id {error_id}",
                       code="internal_error")

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
            skip_special_tokens=req.skip_special_tokens, priority=req.priority,
        )
    except InvalidSamplingParam as e:
        raise OpenAIError(400, f"{e.field} {e.rule}, got {e.value!r}", code="invalid_value", param=e.field) from None
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
            status = {"queue_full": 429, "internal_error": 500}.get(e.code, 400)
            raise OpenAIError(status, str(e), code=e.code) from None
        except EngineUnavailableError as e:
            raise OpenAIError(503, str(e), code=e.code) from None
        except EngineDeadError as e:
            raise OpenAIError(503, str(e), code=e.code) from None

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
                        raise OpenAIError(503, str(item), code=item.code)
                    try:
                        delta = self._apply(item)
                    except OpenAIError:
                        raise
                    except Exception as e:  # noqa: BLE001 -- e.g. a detokenizer error: this request only
                        raise internal_error(f"request {self.request_id}: processing engine output failed",
                                             e) from None
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
        return StreamingResponse(_guarded(stream, events), media_type="text/event-stream")
    result = await run_unless_disconnected(collect, raw_request, stream.abort)
    if result is None:
        return Response(status_code=499)  # the client hung up; nobody reads this
    return JSONResponse(result.model_dump())


async def _guarded(stream: GenerationStream, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, and if anything unexpected breaks them after the 200 went out, an error event and [DONE]
    rather than a cut connection."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 -- the headers are sent: an error event is all that is left
        stream.abort("error")
        yield sse_error(internal_error(f"request {stream.request_id}: streaming failed", e))
        yield SSE_DONE
