"""POST /v1/completions."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from ladle.entrypoints.openai.generation_stream import (
    ChoiceDelta,
    ChoiceState,
    GenerationStream,
    TokenLogprobs,
    TokenTexts,
)
from ladle.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    OpenAIError,
    PromptLogprob,
)
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

Prompt = str | list[int]


def _batch(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """A list of strings or of id lists is a batch; a string or one id list is one prompt."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise OpenAIError(400, "prompt is empty; give a string, a list of token ids, or a batch of either",
                          code="invalid_value", param="prompt")
    return list(prompt)  # type: ignore[arg-type]


def _tokenize(tokenizer: Any, prompts: list[Prompt], vocab_size: int, echo: bool) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt (and its echo text); runs on a tokenizer thread, since a big prompt takes
    seconds. The same encode call as the offline LLM."""
    ids: list[list[int]] = []
    for i, item in enumerate(prompts):
        ids.append(tokenizer.encode(item) if isinstance(item, str) else list(item))
        if not ids[-1]:
            raise OpenAIError(400, f"prompt {i} is empty (no tokens)", code="invalid_value", param="prompt")
        if not isinstance(item, str):
            bad = next((t for t in item if t >= vocab_size), None)
            if bad is not None:
                raise OpenAIError(400, f"prompt {i}: token id {bad} is outside the vocabulary [0, {vocab_size})",
                                  code="invalid_value", param="prompt")
    echoes = [(p if isinstance(p, str) else tokenizer.decode(i)) if echo else "" for p, i in zip(prompts, ids)]
    return ids, echoes


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Any:
        if req.suffix is not None:
            raise OpenAIError(400, "suffix is not supported", code="unsupported_parameter", param="suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise OpenAIError(400, "best_of other than n is not supported", code="unsupported_parameter",
                              param="best_of")
        if req.prompt_logprobs is not None and req.stream:
            # vLLM's rule: a stream's chunks have no place for them (echo with logprobs streams them instead).
            raise OpenAIError(400, "prompt_logprobs are not available with stream: true; use echo with logprobs",
                              code="invalid_value", param="prompt_logprobs")
        prompts = _batch(req.prompt)
        limit = self.ctx.limits.max_prompts_per_request
        if len(prompts) > limit:
            raise OpenAIError(400, f"{len(prompts)} prompts in one request; this server allows at most {limit} "
                              "(--max-prompts-per-request)", code="invalid_value", param="prompt")
        self.ctx.check_choices(len(prompts), req.n)
        structured, param = structured_outputs_of(req)
        # echo with logprobs reports the prompt's tokens too, from prompt logprobs of the same depth (vLLM's).
        prompt_logprobs = req.logprobs if req.prompt_logprobs is None and req.echo else req.prompt_logprobs
        params = sampling_params(req, req.max_tokens, req.logprobs, structured, prompt_logprobs)
        self.ctx.check_stop(params.stop_list)
        await self.ctx.check_structured(params, param, client_of(raw_request))
        vocab = self.ctx.vocab_size()
        chars = sum(len(p) for p in prompts if isinstance(p, str))
        ids, echo = await self.ctx.pool.run(lambda tok: _tokenize(tok, prompts, vocab, req.echo), chars)
        for p in ids:
            self.ctx.check_prompt_length(len(p), "prompt")
        self.ctx.check_logprobs(params, [len(p) for p in ids], "logprobs")
        stream = self.ctx.stream(f"cmpl-{uuid.uuid4().hex}", ids, params, session_id=session_hint(raw_request.headers))
        await stream.start()
        self.ctx.accepted("completions", params)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await respond(stream, self._stream(stream, echo, include_usage), lambda: self._response(stream, echo),
                             bool(req.stream), raw_request)

    def _response(self, stream: GenerationStream, echo: list[str]) -> Iterator[bytes]:
        """The whole answer's JSON, once every choice finished; on a thread (see respond)."""
        want_logprobs = stream.params.logprobs is not None
        choices = (
            CompletionResponseChoice(
                index=c.index, text=echo[c.prompt_index] + c.detok.output_text,
                logprobs=self._echoed(stream, c, echo, _logprobs(c.token_ids, c.logprobs, len(echo[c.prompt_index]),
                                                                 stream.texts)) if want_logprobs else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                prompt_logprobs=_prompt_logprobs(c.prompt_logprobs, stream.texts))
            for c in stream.choices
        )
        return with_choices(CompletionResponse(id=stream.request_id, model=self.ctx.model_name, choices=[],
                                               usage=stream.usage), choices)

    async def _stream(self, stream: GenerationStream, echo: list[str], include_usage: bool) -> AsyncIterator[str]:
        offsets = [len(echo[c.prompt_index]) for c in stream.choices]  # chars of token text sent per choice
        # With logprobs the echo goes with its prompt's logprobs, which come with the choice's first token.
        late_echo = [bool(echo[c.prompt_index]) and stream.params.logprobs is not None for c in stream.choices]
        try:
            for c in stream.choices:
                if echo[c.prompt_index] and not late_echo[c.index]:
                    yield sse(self._chunk(stream, c, echo[c.prompt_index], None).model_dump_json())
            async for deltas in stream.deltas():
                for d in deltas:
                    if late_echo[d.choice.index]:
                        late_echo[d.choice.index] = False
                        echoed = self._echoed(stream, d.choice, echo, CompletionLogProbs())
                        yield sse(self._chunk(stream, d.choice, echo[d.choice.prompt_index], echoed).model_dump_json())
                    logprobs = None
                    if stream.params.logprobs is not None:
                        logprobs = _logprobs(d.token_ids, d.logprobs, offsets[d.choice.index], stream.texts)
                        offsets[d.choice.index] += sum(len(t) for t in logprobs.tokens)
                    elif not d.text and d.finish_reason is None:
                        continue  # nothing to say yet (text held back for a stop string or a split character)
                    yield sse(self._chunk(stream, d.choice, d.text, logprobs, d).model_dump_json())
            if include_usage:
                usage_chunk = CompletionStreamResponse(id=stream.request_id, model=self.ctx.model_name, choices=[],
                                                       usage=stream.usage)
                yield sse(usage_chunk.model_dump_json())
        except OpenAIError as e:
            yield sse_error(e)
        finally:
            stream.abort()  # no-op when it finished; a client that hung up frees its KV blocks here
        yield SSE_DONE

    @staticmethod
    def _echoed(stream: GenerationStream, c: ChoiceState, echo: list[str], generated: CompletionLogProbs
                ) -> CompletionLogProbs:
        """generated, after the echoed prompt's tokens (their text from offset 0, the first without a logprob)
        when the choice echoes its prompt."""
        if not echo[c.prompt_index] or c.prompt_logprobs is None:
            return generated
        prompt = _logprobs(stream.prompts[c.prompt_index], c.prompt_logprobs, 0, stream.texts)
        for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
            getattr(prompt, name).extend(getattr(generated, name))
        return prompt

    def _chunk(self, stream: GenerationStream, c: ChoiceState, text: str, logprobs: CompletionLogProbs | None,
               delta: ChoiceDelta | None = None) -> CompletionStreamResponse:
        finish = delta.finish_reason if delta is not None else None
        choice = CompletionResponseChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=finish,
                                          stop_reason=c.stop_reason if finish else None)
        return CompletionStreamResponse(id=stream.request_id, model=self.ctx.model_name, choices=[choice])


def _logprobs(token_ids: list[int], logprobs: list[TokenLogprobs] | list[TokenLogprobs | None], offset: int,
              texts: TokenTexts) -> CompletionLogProbs:
    """OpenAI's logprobs of these tokens; None entries (the first prompt token's) have text but no logprob."""
    out = CompletionLogProbs()
    for tid, entries in zip(token_ids, logprobs):
        if entries is None:
            token = texts(tid)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            sampled = next((e for e in entries if e[0] == tid), None)
            token = texts(tid) if sampled is not None else ""
            out.token_logprobs.append(sampled[1] if sampled is not None else None)
            out.top_logprobs.append({texts(t): lp for t, lp, _ in sorted(entries, key=lambda e: e[2])})
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def _prompt_logprobs(entries: list[TokenLogprobs | None] | None,
                     texts: TokenTexts) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs field: token id -> (logprob, rank, decoded token), the prompt token first."""
    if entries is None:
        return None
    return [None if e is None else
            {t: PromptLogprob(logprob=lp, rank=rank, decoded_token=texts(t)) for t, lp, rank in e} for e in entries]
