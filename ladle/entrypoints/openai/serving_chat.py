"""POST /v1/chat/completions."""
from __future__ import annotations

import uuid
from typing import Any, AsyncIterator, Iterator

from fastapi import Request
from jinja2 import TemplateError, TemplateSyntaxError

from ladle.entrypoints.openai.protocol import (
    ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse,
    ChatResponseMessage, DeltaMessage, OpenAIError, TopLogprob,
)
from ladle.frontend.message_marks import LAST_MESSAGES, message_ends
from ladle.entrypoints.openai.generation_stream import GenerationStream, TokenLogprobs, TokenTexts
from ladle.entrypoints.openai.structured_request import structured_outputs_of
from ladle.entrypoints.openai.serving_engine import (
    SSE_DONE, ServingContext, respond, sampling_params, sse, sse_error, with_choices,
)


def _prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                mark: bool = False) -> tuple[list[int], tuple[int, ...]]:
    """Render with the tokenizer's chat template and encode without adding special tokens again, as the
    offline LLM.chat does, so one conversation gives the same tokens on both paths; with mark, also where the
    last messages end (ladle.frontend.message_marks). Runs on a tokenizer thread."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateSyntaxError as e:
        # The template itself does not parse: no request can fix that, so it is the server's error.
        raise OpenAIError(500, f"the model's chat template is broken ({e}); no request can be rendered with it",
                          code="chat_template_error") from None
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise OpenAIError(400, f"the chat template could not render these messages: {e}",
                          code="invalid_value", param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise OpenAIError(400, "the messages render to an empty prompt", code="invalid_value", param="messages")
    if not mark:
        return ids, ()
    return ids, message_ends(messages, ids, lambda head: tokenizer.encode(
        tokenizer.apply_chat_template(list(head), tokenize=False, add_generation_prompt=False),
        add_special_tokens=False))


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


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Any:
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
        self.ctx.check_choices(1, req.n)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        structured, param = structured_outputs_of(req)
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, structured)
        self.ctx.check_stop(params.stop)
        await self.ctx.check_structured(params, param)
        self.ctx.vocab_size()  # 503 before any work while no engine is ready
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            m.setdefault("content", "")
        chars = sum(len(m["content"]) if isinstance(m["content"], str) else sum(len(p["text"]) for p in m["content"])
                    for m in messages)
        mark = self.ctx.checkpointing()
        ids, marks = await self.ctx.pool.run(lambda tok: _prompt_ids(tok, messages, req.add_generation_prompt, mark),
                                             chars * (1 + mark * LAST_MESSAGES))
        self.ctx.check_prompt_length(len(ids), "messages")
        self.ctx.check_logprobs(params, [len(ids)], "top_logprobs")
        stream = self.ctx.stream(f"chatcmpl-{uuid.uuid4().hex}", [ids], params, marks)
        await stream.start()
        top_n = req.top_logprobs or 0
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await respond(stream, self._stream(stream, top_n, include_usage), lambda: self._response(stream, top_n),
                             bool(req.stream), raw_request)

    def _response(self, stream: GenerationStream, top_n: int) -> Iterator[bytes]:
        """The whole answer's JSON, once every choice finished; on a thread (see respond)."""
        want_logprobs = stream.params.logprobs is not None
        choices = (
            ChatCompletionResponseChoice(
                index=c.index, message=ChatResponseMessage(content=c.detok.output_text),
                logprobs=_logprobs(c.token_ids, c.logprobs, top_n, stream.texts) if want_logprobs else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            )
            for c in stream.choices
        )
        return with_choices(ChatCompletionResponse(id=stream.request_id, model=self.ctx.model_name, choices=[],
                                                   usage=stream.usage), choices)

    def _chunk(self, stream: GenerationStream, choice: ChatCompletionResponseStreamChoice) -> str:
        return sse(ChatCompletionStreamResponse(id=stream.request_id, model=self.ctx.model_name,
                                                choices=[choice]).model_dump_json())

    async def _stream(self, stream: GenerationStream, top_n: int, include_usage: bool) -> AsyncIterator[str]:
        want_logprobs = stream.params.logprobs is not None
        try:
            for c in stream.choices:  # OpenAI opens every choice with the role
                yield self._chunk(stream, ChatCompletionResponseStreamChoice(
                    index=c.index, delta=DeltaMessage(role="assistant", content="")))
            async for deltas in stream.deltas():
                for d in deltas:
                    if not want_logprobs and not d.text and d.finish_reason is None:
                        continue  # text held back (a stop string may be starting, or a character is split)
                    logprobs = _logprobs(d.token_ids, d.logprobs, top_n, stream.texts) if want_logprobs else None
                    yield self._chunk(stream, ChatCompletionResponseStreamChoice(
                        index=d.choice.index, delta=DeltaMessage(content=d.text), logprobs=logprobs,
                        finish_reason=d.finish_reason, stop_reason=d.choice.stop_reason if d.finish_reason else None,
                    ))
            if include_usage:
                yield sse(ChatCompletionStreamResponse(id=stream.request_id, model=self.ctx.model_name, choices=[],
                                                       usage=stream.usage).model_dump_json())
        except OpenAIError as e:
            yield sse_error(e)
        finally:
            stream.abort()  # no-op when it finished; a client that hung up frees its KV blocks here
        yield SSE_DONE


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
