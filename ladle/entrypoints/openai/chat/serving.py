"""POST /v1/chat/completions."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from jinja2 import TemplateSyntaxError
from pydantic import ValidationError

from ladle.entrypoints.openai.chat.output import ChoicePiece, ChoiceReader, finish_reason, read_whole
from ladle.entrypoints.openai.chat.render import chars, chat_prompt, render
from ladle.entrypoints.openai.chat.tools import ToolPlan, constrain, gated, tool_plan
from ladle.entrypoints.openai.field_policy import CHAT_EFFORT
from ladle.entrypoints.openai.generation_stream import GenerationStream, TokenLogprobs, TokenTexts
from ladle.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    OpenAIError,
    TopLogprob,
)
from ladle.entrypoints.openai.reasoning_effort import effort_kwargs, template_controls
from ladle.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ServingContext,
    client_of,
    respond,
    sampling_params,
    sse,
    sse_error,
    with_choices,
)
from ladle.entrypoints.openai.session_routing import session_hint
from ladle.entrypoints.openai.structured_request import structured_outputs_of
from ladle.entrypoints.openai.tool_protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCallOut
from ladle.frontend.message_marks import LAST_MESSAGES


def chat_template_problem(tokenizer: Any) -> str | None:
    """Why the checkpoint's chat template does not parse (None when it does, or when there is none), so the
    server can say so at startup rather than at the first chat request."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a private helper of transformers: without it the first request tells
        return None
    template = getattr(tokenizer, "chat_template", None) or {}
    for text in template.values() if isinstance(template, dict) else [template]:
        try:
            _compile_jinja_template(text)
        except TemplateSyntaxError as e:
            return str(e)
    return None


_APIS = {"chatcmpl": "chat_completions", "msg": "messages", "resp": "responses"}  # by response-id prefix


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request was read into, checked as a chat request is (a 400 names the
    field that fails)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise OpenAIError(400, f"{where}: {first.get('msg')}", param=where.split(".")[0] or None) from None


@dataclass
class PreparedChat:
    stream: GenerationStream | None  # None when only counted
    plan: ToolPlan
    thinking: bool  # the prompt left a thinking block open
    prompt_tokens: int


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        reasoning = ctx.chat.reasoning
        self.think = reasoning.think_tags(ctx.tokenizer) if reasoning is not None else None
        self.effort_controls = template_controls(ctx.tokenizer, ctx.chat.chat_template)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Any:
        chat = await self.prepare(req, "chatcmpl", client=client_of(raw_request),
                                  session=session_hint(raw_request.headers, req.prompt_cache_key))
        if effort_kwargs(req.reasoning_effort, self.effort_controls)[1]:
            self.ctx.metrics.no_ops("chat_completions", [CHAT_EFFORT])
        stream, plan, thinking = chat.stream, chat.plan, chat.thinking
        assert stream is not None  # submitted: prepare counts only when asked to
        top_n = req.top_logprobs or 0
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await respond(stream, self._stream(stream, top_n, include_usage, plan, thinking),
                             lambda: self._response(stream, top_n, plan, thinking), bool(req.stream), raw_request)

    async def prepare(self, req: ChatCompletionRequest, id_prefix: str, count_only: bool = False,
                      client: str = "", grammars: Mapping[str, str] | None = None,
                      session: str | None = None) -> PreparedChat:
        """Everything a chat request needs before its answer is written (the other APIs that speak chat, the
        Anthropic Messages API, share it): checked, constrained, rendered and, unless count_only, submitted;
        client: the peer, whose turn its grammar compile takes; grammars: the Lark grammars of the functions that
        stand for custom tools (the Responses API's), by name; session: the client's session key
        (session_routing.session_hint), whose next turn the prefix cache keeps this one's prefix for."""
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
        self.ctx.check_choices(1, req.n)
        settings = self.ctx.chat
        plan = tool_plan(req, settings, grammars)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        structured, param = structured_outputs_of(req)
        structured, param = constrain(plan, settings, req.parallel_tool_calls, structured, param,
                                      self.ctx.grammars.limits)
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, structured)
        self.ctx.check_stop(params.stop_list)
        await self.ctx.check_structured(params, param, client)
        if not count_only:
            self.ctx.vocab_size()  # 503 before any work while no engine is ready
        prompt = chat_prompt(req, settings.chat_template, self.effort_controls)
        mark = self.ctx.checkpointing() and not count_only
        ids, marks, text = await self.ctx.pool.run(lambda tok: render(tok, prompt, mark),
                                                   chars(prompt) * (1 + mark * LAST_MESSAGES))
        thinking = settings.reasoning is not None and settings.reasoning.starts_thinking(text)
        params = gated(params, settings, self.think, text)
        if count_only:
            return PreparedChat(None, plan, thinking, len(ids))
        self.ctx.check_prompt_length(len(ids), "messages")
        self.ctx.check_logprobs(params, [len(ids)], "top_logprobs")
        stream = self.ctx.stream(f"{id_prefix}-{uuid.uuid4().hex}", [ids], params, marks, session)
        await stream.start()
        self.ctx.accepted(_APIS[id_prefix], params)
        return PreparedChat(stream, plan, thinking, len(ids))

    def _response(self, stream: GenerationStream, top_n: int, plan: ToolPlan, thinking: bool) -> Iterator[bytes]:
        """The whole answer's JSON, once every choice finished; on a thread (see respond)."""
        want_logprobs = stream.params.logprobs is not None

        def choice(c: Any) -> ChatCompletionResponseChoice:
            piece, calls = read_whole(self.ctx.chat, plan, thinking, c.detok.output_text,
                                  self.ctx.count_tool_calls)
            content = None if calls and not piece.content.strip() else piece.content
            message = ChatResponseMessage(content=content, reasoning_content=piece.reasoning or None, tool_calls=[
                ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in calls])
            return ChatCompletionResponseChoice(
                index=c.index, message=message,
                logprobs=_logprobs(c.token_ids, c.logprobs, top_n, stream.texts) if want_logprobs else None,
                finish_reason=finish_reason(c.finish_reason, calls), stop_reason=c.stop_reason)

        return with_choices(ChatCompletionResponse(id=stream.request_id, model=self.ctx.model_name, choices=[],
                                                   usage=stream.usage), map(choice, stream.choices))

    def _chunk(self, stream: GenerationStream, choice: ChatCompletionResponseStreamChoice) -> str:
        return sse(ChatCompletionStreamResponse(id=stream.request_id, model=self.ctx.model_name,
                                                choices=[choice]).model_dump_json())

    async def _stream(self, stream: GenerationStream, top_n: int, include_usage: bool, plan: ToolPlan,
                      thinking: bool) -> AsyncIterator[str]:
        want_logprobs = stream.params.logprobs is not None
        readers = {c.index: ChoiceReader(self.ctx.chat, plan, thinking, self.ctx.count_tool_calls)
                   for c in stream.choices}
        try:
            for c in stream.choices:  # OpenAI opens every choice with the role
                yield self._chunk(stream, ChatCompletionResponseStreamChoice(
                    index=c.index, delta=DeltaMessage(role="assistant", content="")))
            async for deltas in stream.deltas():
                for d in deltas:
                    reader = readers[d.choice.index]
                    piece = reader.feed(d.text)
                    if d.finish_reason is not None:
                        rest = reader.finish()
                        piece = ChoicePiece(piece.reasoning + rest.reasoning, piece.content + rest.content,
                                            piece.tool_calls + rest.tool_calls)
                    if not want_logprobs and not piece and d.finish_reason is None:
                        continue  # text held back (a stop string or a tag may be starting, a character is split)
                    logprobs = _logprobs(d.token_ids, d.logprobs, top_n, stream.texts) if want_logprobs else None
                    yield self._chunk(stream, ChatCompletionResponseStreamChoice(
                        index=d.choice.index, delta=_delta(piece), logprobs=logprobs,
                        finish_reason=finish_reason(d.finish_reason, reader.calls),
                        stop_reason=d.choice.stop_reason if d.finish_reason else None,
                    ))
            if include_usage:
                yield sse(ChatCompletionStreamResponse(id=stream.request_id, model=self.ctx.model_name, choices=[],
                                                       usage=stream.usage).model_dump_json())
        except OpenAIError as e:
            yield sse_error(e)
        finally:
            stream.abort()  # no-op when it finished; a client that hung up frees its KV blocks here
        yield SSE_DONE


def _delta(piece: ChoicePiece) -> DeltaMessage:
    calls = [DeltaToolCall(index=t.index, id=t.id, type="function" if t.id else None,
                           function=DeltaFunctionCall(name=t.name, arguments=t.arguments))
             for t in piece.tool_calls]
    # Plain text keeps its content (even empty, on a finishing chunk); a piece of thinking or calls only says so.
    content = piece.content if piece.content or not (piece.reasoning or calls) else None
    return DeltaMessage(content=content, reasoning_content=piece.reasoning or None, tool_calls=calls or None)


def _entry(token_id: int, logprob: float, texts: TokenTexts) -> TopLogprob:
    token = texts(token_id)
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def _logprobs(token_ids: list[int], logprobs: list[TokenLogprobs], top_n: int,
              texts: TokenTexts) -> ChatCompletionLogProbs:
    content = []
    for tid, entries in zip(token_ids, logprobs):
        sampled = next((e for e in entries if e[0] == tid), None)
        if sampled is None:
            continue
        top = sorted((e for e in entries if e[2] <= top_n), key=lambda e: e[2])[:top_n]
        content.append(ChatCompletionLogProbsContent(**_entry(tid, sampled[1], texts).model_dump(),
                                                     top_logprobs=[_entry(t, lp, texts) for t, lp, _ in top]))
    return ChatCompletionLogProbs(content=content)
