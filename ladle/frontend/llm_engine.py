"""The offline frontend: tokenizer + EngineCore + OutputProcessor, stepped by the caller."""
from __future__ import annotations

import contextlib
from typing import Any

from ladle.config.engine_args import EngineArgs
from ladle.engine.core import EngineCore
from ladle.frontend.output_processor import OutputProcessor
from ladle.outputs import RequestOutput
from ladle.request import Request
from ladle.sampling_params import SamplingParams
from ladle.structured_output.checker import GrammarChecker
from ladle.structured_output.matcher import GrammarError, tokenizer_spec
from ladle.tokenizer import load_tokenizer

PromptType = str | dict[str, Any]


class LLMEngine:
    def __init__(self, args: EngineArgs, explicit: frozenset[str]) -> None:
        self.core = EngineCore(args, explicit)
        self.tokenizer = load_tokenizer(self.core.config.tokenizer)
        self.processor = OutputProcessor(self.tokenizer)
        self.grammars = GrammarChecker()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        args, explicit = EngineArgs.from_kwargs(**kwargs)
        return cls(args, explicit)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError("a prompt is a str, {'prompt_token_ids': [...]} or {'prompt': str}; "
                        f"got {type(prompt).__name__}")

    def make_requests(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      checkpoint_marks: tuple[int, ...] = (), session_id: str | None = None) -> list[Request]:
        """The core requests for one user request (n of them for n > 1), checked so that they can run (a
        structured-output constraint that does not compile raises InvalidStructuredOutput, a ValueError)."""
        if params.structured_outputs is not None:
            if not self.grammars.sandbox.has_tokenizer:
                with contextlib.suppress(GrammarError):  # the engine fails such a request, saying why
                    self.grammars.set_tokenizer(tokenizer_spec(self.tokenizer, self.core.hf_config.vocab_size,
                                                               sorted(self.core.eos_token_ids)))
            self.grammars.check(params.structured_outputs)
        return self.core.make_requests(request_id, [prompt_token_ids], params, checkpoint_marks, session_id)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, requests: list[Request] | None = None,
                    session_id: str | None = None) -> None:
        """session_id: the client's session (offline too: an agent loop on LLMEngine), for which the prefix cache
        keeps the request's prefix when it ends (ladle.kv_cache.session_retention)."""
        if requests is None:
            requests = self.make_requests(request_id, prompt_token_ids, params, session_id=session_id)
        elif session_id is not None:
            raise ValueError("add_request: pass session_id to make_requests when giving the requests")
        for req in requests:
            self.core.add_request(req)
        self.processor.add(request_id, prompt, prompt_token_ids, params, [r.request_id for r in requests])

    def abort_request(self, child_ids: list[str]) -> None:
        self.processor.process(self.core.abort_requests(child_ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs
