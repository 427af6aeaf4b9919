"""One API request in the engine, as the endpoints see it: its choices (one engine request each), the token
stream the engine process sends for them, detokenized incrementally on the API side.

Everything here runs on the event loop, so it runs in slices: a backlog (a stream whose client paused while
the engine kept generating) is taken at most _SLICE outputs at a time, each child's outputs in a slice are
detokenized as one update (unless the request has stop strings), and the loop serves other clients between
slices. One burst over the whole backlog froze every client for 13-15 s after a 40 s pause.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ladle.engine.core_output import EngineCoreOutput
from ladle.entrypoints.openai.metrics import ServerMetrics
from ladle.entrypoints.openai.protocol import OpenAIError, PromptTokensDetails, UsageInfo, internal_error
from ladle.frontend.child_state import ChildState, child_states
from ladle.outputs import Logprob
from ladle.request import RequestRejected, child_request_ids
from ladle.sampling_params import SamplingParams
from ladle.serving.async_client import AsyncEngineClient, EngineDeadError, EngineUnavailableError, RequestHandle

_SLICE = 128  # engine outputs handled between two turns of the event loop


class TokenTexts:
    """Each token's text alone, as logprobs report it, decoded once per token id (a vocabulary's worth at
    most) instead of once per candidate of every generated token."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


# One generated token's logprobs: (token id, logprob, rank), the sampled token first, then the top ones. Plain
# tuples of numbers, which the garbage collector stops tracking: the Logprob objects of a big answer held in
# flight made each full collection walk them all (up to 560 ms with the event loop stopped).
TokenLogprobs = tuple[tuple[int, float, int], ...]


def compact(logprobs: dict[int, Logprob] | None) -> TokenLogprobs:
    return tuple((tid, lp.logprob, lp.rank) for tid, lp in (logprobs or {}).items())


@dataclass(kw_only=True)
class ChoiceState(ChildState):
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs, from the first token on: None for the first prompt token, then its own.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    last_token_time: float | None = None


@dataclass
class ChoiceDelta:
    choice: ChoiceState
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]

    @property
    def finish_reason(self) -> str | None:
        return self.choice.finish_reason


def coalesce(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """One output per child, in order of first appearance: its tokens and logprobs joined, the last one's
    ending. A child's outputs after its finish cannot come (the engine sends none), so order is kept."""
    merged: dict[str, EngineCoreOutput] = {}
    for out in outputs:
        prev = merged.get(out.request_id)
        if prev is None:
            merged[out.request_id] = EngineCoreOutput(out.request_id, list(out.new_token_ids),
                                                      list(out.new_logprobs), out.finish_reason, out.stop_reason,
                                                      out.stop_token, out.error, out.error_code,
                                                      num_cached_tokens=out.num_cached_tokens,
                                                      prompt_logprobs=out.prompt_logprobs)
        else:
            prev.new_token_ids.extend(out.new_token_ids)
            prev.new_logprobs.extend(out.new_logprobs)
            prev.finish_reason, prev.stop_reason, prev.error = out.finish_reason, out.stop_reason, out.error
            prev.stop_token, prev.error_code = out.stop_token, out.error_code
    return list(merged.values())


class GenerationStream:
    """One API request in the engine: n choices per prompt, each an engine request of its own (a child)."""

    def __init__(self, client: AsyncEngineClient, tokenizer: Any, texts: TokenTexts, metrics: ServerMetrics,
                 request_id: str, prompts: list[list[int]], params: SamplingParams,
                 checkpoint_marks: tuple[int, ...] = (), session_id: str | None = None) -> None:
        self.client, self.texts, self.metrics = client, texts, metrics  # texts: for the endpoints' logprobs
        self.request_id, self.prompts, self.params = request_id, prompts, params
        self.checkpoint_marks, self.session_id = checkpoint_marks, session_id
        self.arrival = time.monotonic()
        self.first_token_seen = False
        self.cached_tokens: dict[str, int] = {}  # per child: prompt tokens the prefix cache served it
        # Named as the engine names them.
        self.choices = child_states(ChoiceState, tokenizer, child_request_ids(request_id, len(prompts) * params.n),
                                    prompts, params)
        self._by_child = {c.child_id: c for c in self.choices}
        self._handle: RequestHandle | None = None
        self.finished = False
        # Joined updates give the same text, but a stop string must be found at the output that made it, so
        # the tokens after it are not counted: with stop strings each output is its own update.
        self._coalesce = not any(params.stop_list)

    async def start(self) -> None:
        """Submit to the engine; raises OpenAIError if it will not take the request."""
        try:
            self._handle = await self.client.add_request(self.request_id, self.prompts, self.params,
                                                         self.checkpoint_marks, self.session_id)
        except RequestRejected as e:
            status = {"queue_full": 429, "internal_error": 500}.get(e.code, 400)
            raise OpenAIError(status, str(e), code=e.code) from None
        except (EngineUnavailableError, EngineDeadError) as e:
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
        # Children of one prompt share it, so each prompt counts its best-served child (vLLM counts the first).
        cached = sum(max((self.cached_tokens.get(c.child_id, 0) for c in self.choices if c.prompt_index == i),
                         default=0) for i in range(len(self.prompts)))
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Yields what each slice of engine outputs added; raises OpenAIError if the engine dies."""
        assert self._handle is not None, "start() first"
        queue = self._handle.queue
        try:
            while any(c.finish_reason is None for c in self.choices):
                items = [await queue.get()]
                while len(items) < _SLICE and not queue.empty():
                    items.append(queue.get_nowait())
                dead = next((i for i in items if isinstance(i, EngineDeadError)), None)
                outputs = [i for i in items if not isinstance(i, EngineDeadError)]
                if self._coalesce:
                    outputs = coalesce(outputs)
                deltas = [d for d in map(self._apply_guarded, outputs) if d is not None]
                if deltas:
                    yield deltas
                if dead is not None:
                    raise OpenAIError(503, str(dead), code=dead.code)
                if not queue.empty():
                    await asyncio.sleep(0)  # a backlog: the other clients' turn before the next slice
        except OpenAIError:
            self.abort("error")  # the engine died or failed one choice: stop the others
            raise
        except BaseException:
            self.abort()  # the consumer went away
            raise
        self.finished = True
        self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrival)

    def _apply_guarded(self, out: EngineCoreOutput) -> ChoiceDelta | None:
        try:
            return self._apply(out)
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001 -- e.g. a detokenizer error: this request only
            raise internal_error(f"request {self.request_id}: processing engine output failed", e) from None

    def _apply(self, out: EngineCoreOutput) -> ChoiceDelta | None:
        ch = self._by_child.get(out.request_id)
        if ch is None or ch.finish_reason is not None:
            return None  # e.g. tokens that raced with our abort after a stop string
        if out.finish_reason == "error":
            if out.error_code == "invalid_grammar":
                raise OpenAIError(400, f"this request's structured output cannot be enforced: {out.error}",
                                  code="invalid_value")
            raise OpenAIError(500, f"the engine failed this request: {out.error}", code="engine_error")
        if out.num_cached_tokens is not None:
            self.cached_tokens[ch.child_id] = out.num_cached_tokens
        now = time.monotonic()
        if out.new_token_ids:
            if not self.first_token_seen:
                self.first_token_seen = True
                self.metrics.time_to_first_token.observe(now - self.arrival)
            elif ch.last_token_time is not None:
                self.metrics.inter_token_latency.observe(now - ch.last_token_time)
            ch.last_token_time = now
        new_logprobs = [compact(lp) for lp in out.new_logprobs] if self.params.logprobs is not None else []
        ch.token_ids.extend(out.new_token_ids)
        ch.logprobs.extend(new_logprobs)
        if out.prompt_logprobs is not None:
            ch.prompt_logprobs = [None if lp is None else compact(lp) for lp in out.prompt_logprobs]
        if ch.apply(out):
            self.client.abort(self.request_id, [ch.child_id])  # a stop string ended it
        if ch.finish_reason is not None:
            self.metrics.finished(ch.finish_reason)
        return ChoiceDelta(ch, ch.detok.text_delta(), list(out.new_token_ids), new_logprobs)
