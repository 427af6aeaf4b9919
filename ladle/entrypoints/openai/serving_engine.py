"""What /v1/completions and /v1/chat/completions share: the context, limits and errors, sampling params, and
the HTTP response of one API request (streamed, or built and serialized off the event loop)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from ladle.entrypoints.openai.chat.settings import ChatSettings
from ladle.entrypoints.openai.generation_stream import GenerationStream, TokenTexts
from ladle.entrypoints.openai.metrics import ServerMetrics
from ladle.entrypoints.openai.protocol import OpenAIError, SamplingRequest, clip, internal_error
from ladle.entrypoints.openai.sse_keepalive import with_keepalive
from ladle.entrypoints.openai.tokenizer_pool import TokenizerPool
from ladle.sampling_params import InvalidSamplingParam, SamplingParams, StructuredOutputsParams
from ladle.serving.async_client import AsyncEngineClient
from ladle.structured_output.checker import GrammarChecker
from ladle.structured_output.grammar import InvalidStructuredOutput
from ladle.structured_output.matcher import GrammarError, tokenizer_spec
from ladle.structured_output.sandbox import SandboxBusy

T = TypeVar("T")


@dataclass(frozen=True)
class ServingLimits:
    """How much one API request may ask for (each choice is an engine request of its own)."""
    max_prompts_per_request: int = 256
    max_choices_per_request: int = 512  # prompts x n
    max_stop_strings: int = 256
    max_stop_chars: int = 16384  # all of a request's stop strings together
    max_logprobs_per_request: int = 262144  # choices x max_tokens x (logprobs + 1) entries


@dataclass
class ServingContext:
    """What both OpenAI endpoints work with."""
    client: AsyncEngineClient
    tokenizer: Any  # decoding, on the event loop
    pool: TokenizerPool  # encoding and chat templates, off it
    metrics: ServerMetrics
    model_name: str
    limits: ServingLimits = field(default_factory=ServingLimits)
    chat: ChatSettings = field(default_factory=ChatSettings)  # tool-call and reasoning parsers, chat template
    texts: TokenTexts = field(init=False)
    grammars: GrammarChecker = field(default_factory=GrammarChecker)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer)

    def stream(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
               checkpoint_marks: tuple[int, ...] = (), session_id: str | None = None) -> GenerationStream:
        return GenerationStream(self.client, self.tokenizer, self.texts, self.metrics, request_id, prompts, params,
                                checkpoint_marks, session_id)

    def accepted(self, api: str, params: SamplingParams) -> None:
        """A request the engine took, for /metrics (by API; constrained ones counted too)."""
        if self.metrics is not None:
            self.metrics.accepted(api, params.structured_outputs is not None)

    def count_tool_calls(self, n: int) -> None:
        """A reply's calls, for /metrics (ladle:tool_calls_total)."""
        if n and self.metrics is not None:
            self.metrics.tool_calls.inc(n)

    def checkpointing(self) -> bool:
        """Whether the engine keeps state checkpoints, so marking where messages end pays."""
        info = self.client.info
        return info is not None and info.checkpointing

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


    async def check_structured(self, params: SamplingParams, param: str, client: str = "") -> None:
        """A structured-output constraint is compiled in the grammar sandbox (as the engine will compile it, once
        the engine is ready) before the request is queued, so one that cannot be enforced, or that crashes or
        outlasts the compiler, is a 400 naming the field; client: whose compile slot turn it takes."""
        spec = params.structured_outputs
        if spec is None:
            return
        info = self.client.info
        if info is not None and not self.grammars.sandbox.has_tokenizer:
            try:
                tok = await self.pool.run(lambda t: tokenizer_spec(t, info.vocab_size, info.eos_token_ids))
                self.grammars.set_tokenizer(tok)
            except GrammarError:
                pass  # the engine fails such a request with the same reason
        try:
            await asyncio.wrap_future(self.grammars.submit(spec, client))
        except InvalidStructuredOutput as e:
            param = e.field if param == "structured_outputs" else param  # the object's own field
            raise OpenAIError(400, f"{param}: {clip(e.message, 2000)}", code="invalid_value", param=param) from None
        except SandboxBusy as e:
            raise OpenAIError(503, str(e), code="server_busy") from None

    def check_stop(self, stop: list[str]) -> None:
        """Stop strings are matched on the event loop: bounded in count and size, so no request can hold it."""
        lim = self.limits
        if len(stop) > lim.max_stop_strings:
            raise OpenAIError(400, f"{len(stop)} stop strings; this server allows at most {lim.max_stop_strings} "
                              "(--max-stop-strings)", code="invalid_value", param="stop")
        chars = sum(len(s) for s in stop)
        if chars > lim.max_stop_chars:
            raise OpenAIError(400, f"the stop strings total {chars} characters; this server allows at most "
                              f"{lim.max_stop_chars} (--max-stop-chars)", code="invalid_value", param="stop")

    def check_logprobs(self, params: SamplingParams, prompt_lens: list[int], param: str) -> None:
        """Each logprob entry is built and serialized by this process: choices x tokens x (top + 1) is bounded,
        counting a missing max_tokens as the room the context leaves."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return
        info = self.client.info
        room = [params.max_tokens if params.max_tokens is not None else
                max(0, (info.max_model_len if info else n) - n) for n in prompt_lens]
        entries = 0 if params.logprobs is None else params.n * sum(room) * (params.logprobs + 1)
        prompt = 0 if params.prompt_logprobs is None else params.n * sum(prompt_lens) * (params.prompt_logprobs + 1)
        limit = self.limits.max_logprobs_per_request
        if entries + prompt > limit:
            asked = (f"{len(prompt_lens)} prompt(s) x n={params.n} x up to {max(room)} tokens x "
                     f"{params.logprobs + 1} logprobs" if entries and params.logprobs is not None else "")
            if prompt and params.prompt_logprobs is not None:
                asked += (" and " if asked else "") + (f"n={params.n} x {sum(prompt_lens)} prompt tokens x "
                                                       f"{params.prompt_logprobs + 1} prompt logprobs")
            raise OpenAIError(400, f"{asked} asks for {entries + prompt} logprob entries; this server allows at "
                              f"most {limit} per request (--max-logprobs-per-request): lower n, max_tokens, the "
                              f"prompt or the logprobs asked for", code="invalid_value", param=param)


def client_of(raw_request: Request | None) -> str:
    """Whose turn a request's grammar compile takes (the peer's address; "" when unknown)."""
    peer = raw_request.client if raw_request is not None else None
    return peer.host if peer is not None else ""


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(err: OpenAIError) -> str:
    return sse(err.response().model_dump_json())


SSE_DONE = sse("[DONE]")


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutputsParams | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
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
            skip_special_tokens=req.skip_special_tokens, priority=req.priority, structured_outputs=structured,
            num_speculative_tokens=req.num_speculative_tokens, prompt_logprobs=prompt_logprobs,
        )
    except InvalidSamplingParam as e:
        raise OpenAIError(400, f"{e.field} {e.rule}, got {e.value!r}", code="invalid_value", param=e.field) from None
    except ValueError as e:
        raise OpenAIError(400, str(e), code="invalid_value") from None


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


async def respond(stream: GenerationStream, events: AsyncIterator[str], build: Callable[[], Iterator[bytes]],
                  want_stream: bool, raw_request: Request) -> Response:
    """Stream SSE events, or wait for every choice (unless the client hangs up first) and then build the
    response's JSON (build: its pieces) on a thread: with logprobs that is seconds of work the event loop
    must not do."""
    if want_stream:
        return StreamingResponse(_guarded(stream, events), media_type="text/event-stream")

    async def collect() -> bytes:
        async for _ in stream.deltas():
            pass
        return await asyncio.to_thread(lambda: b"".join(build()))

    body = await run_unless_disconnected(collect, raw_request, stream.abort)
    if body is None:
        return Response(status_code=499)  # the client hung up; nobody reads this
    return Response(body, media_type="application/json")


def json_pieces(model: BaseModel, min_list: int = 16) -> Iterator[bytes]:
    """model.model_dump_json(), in pieces: a list of min_list or more items is written an element (a model) or
    min_list elements (plain values) at a time.
    pydantic serializes in Rust holding the GIL, so the 5 MiB answer of a logprobs request written in one call
    held the event loop off for 400 ms; pieces let the loop in between (at the interpreter's switch interval)."""
    sep = b"{"
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel) and _has_long_list(value, min_list):
            yield sep + b'"%s":' % name.encode()
            yield from json_pieces(value, min_list)
        elif isinstance(value, list) and len(value) >= min_list:
            yield sep + b'"%s":[' % name.encode()
            if all(isinstance(v, BaseModel) for v in value):
                for i, item in enumerate(value):
                    yield from ([b","] if i else [])
                    yield from json_pieces(item, min_list)
            else:  # plain values (logprob dicts, offsets): min_list of them a call, by index
                head = len(name) + 5  # {"name":[
                for i in range(0, len(value), min_list):
                    yield from ([b","] if i else [])
                    part = set(range(i, min(i + min_list, len(value))))  # past the end, pydantic wraps around
                    yield model.model_dump_json(include={name: part}).encode()[head:-2]
            yield b"]"
        else:
            yield sep + model.model_dump_json(include={name}).encode()[1:-1]
        sep = b","
    yield b"}" if sep == b"," else b"{}"


def with_choices(response: BaseModel, choices: Iterable[BaseModel]) -> Iterator[bytes]:
    """The JSON of a response whose (empty) choices list is filled from `choices`, each made, written and
    dropped in turn: the models of one choice are alive at a time, not every choice's logprobs at once."""
    head, found, tail = response.model_dump_json().encode().partition(b'"choices":[]')
    assert found, "the response's choices must be empty"
    yield head + b'"choices":['
    for i, choice in enumerate(choices):
        yield from ([b","] if i else [])
        yield from json_pieces(choice)
    yield b"]" + tail


def _has_long_list(model: BaseModel, min_list: int) -> bool:
    for value in (getattr(model, n) for n in type(model).model_fields):
        if (isinstance(value, list) and len(value) >= min_list) or \
                (isinstance(value, BaseModel) and _has_long_list(value, min_list)):
            return True
    return False


async def _guarded(stream: GenerationStream, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, kept alive through long silences (sse_keepalive), and if anything unexpected breaks them after
    the 200 went out, an error event and [DONE] rather than a cut connection."""
    try:
        async for event in with_keepalive(events):
            yield event
    except Exception as e:  # noqa: BLE001 -- the headers are sent: an error event is all that is left
        stream.abort("error")
        yield sse_error(internal_error(f"request {stream.request_id}: streaming failed", e))
        yield SSE_DONE
