"""Offline batch generation, shaped like vLLM's LLM: every prompt goes through the one engine core."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, cast

from tqdm import tqdm

from ladle.config.engine_args import EngineArgs
from ladle.engine.stats import EngineStats
from ladle.entrypoints.openai.chat.system_placement import fold_system, has_later_system, renders_system_in_place
from ladle.frontend.llm_engine import LLMEngine, PromptType
from ladle.frontend.message_marks import message_ends
from ladle.outputs import RequestOutput
from ladle.sampling_params import SamplingParams

Conversation = list[dict[str, str]]


class LLM:
    """LLM(model=DIR, **engine_args); the engine args are those of ladle.config.engine_args.EngineArgs."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self._start(LLMEngine.from_kwargs(model=model, **engine_args))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, explicit: frozenset[str]) -> LLM:
        """From EngineArgs already built (and validated), e.g. by the command line."""
        llm = cls.__new__(cls)
        llm._start(LLMEngine(args, explicit))
        return llm

    def _start(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._next_id = 0

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks and grammar workers now (they stop anyway when this
        process exits)."""
        self.engine.grammars.shutdown()
        self.engine.core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def config(self):
        return self.engine.core.config

    @property
    def stats(self) -> EngineStats:
        return self.engine.core.stats

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's LLM.reset_prefix_cache), e.g. between benchmark repeats."""
        return self.engine.core.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (use_tqdm: show a progress bar, or a tqdm factory to make it; priority:
        one per prompt, lower first, for an engine with scheduling_policy="priority").
        All prompts are checked before any work starts: if one can never fit
        (prompt + max_tokens > max_model_len, or more KV than the whole pool), the call raises ValueError
        naming that prompt and runs nothing."""
        return self._generate(prompts, sampling_params, use_tqdm, priority)

    def _generate(self, prompts: PromptType | Sequence[PromptType], sampling_params: SamplingParams |
                  Sequence[SamplingParams] | None, use_tqdm: bool | Callable[..., tqdm], priority: Sequence[int] | None,
                  marks: Sequence[tuple[int, ...]] | None = None) -> list[RequestOutput]:
        """generate, with chat's message ends per prompt (marks) for a state model's checkpoints."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; give one per prompt")
            params_list = [replace(p, priority=v) for p, v in zip(params_list, priority)]
        pending = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            text, ids = self.engine.tokenize(prompt)
            rid = str(self._next_id + i)
            try:
                reqs = self.engine.make_requests(rid, ids, params, marks[i] if marks else ())
            except ValueError as e:
                e.args = (f"prompt {i}: {e}",)  # keeps the type and its fields (code, field)
                raise
            pending.append((rid, text, ids, params, reqs))
        self._next_id += len(prompts)
        for rid, text, ids, params, reqs in pending:
            self.engine.add_request(rid, text, ids, params, reqs)
        return self._run([p[0] for p in pending], use_tqdm)

    generate_batch = generate  # the same call into the same core, for users of that name

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template (tools and chat_template_kwargs, e.g.
        enable_thinking, go to it, as in vLLM's LLM.chat) and generate; the replies are the model's raw text."""
        if not messages:
            raise ValueError("messages is empty; give at least one message")
        # One conversation's first item is a message, a batch's a conversation (mypy cannot narrow by an item).
        conversations = ([cast(Conversation, messages)] if isinstance(messages[0], dict)
                         else list(cast(Sequence[Conversation], messages)))
        tok = self.engine.tokenizer
        prompts: list[PromptType] = []
        marks: list[tuple[int, ...]] = []

        def text_of(conv: Sequence[dict], generation_prompt: bool, tools: Any = tools) -> str:
            text = tok.apply_chat_template(list(conv), tokenize=False, add_generation_prompt=generation_prompt,
                                           chat_template=chat_template, tools=tools, **(chat_template_kwargs or {}))
            assert isinstance(text, str)  # tokenize=False: the rendered text
            return text

        def render(conv: Sequence[dict], generation_prompt: bool) -> tuple[str, list[int]]:
            text = text_of(conv, generation_prompt)
            return text, tok.encode(text, add_special_tokens=False)

        for conv in conversations:
            # As the server renders them (openai/chat/render.py): a later system message where the template can put
            # it, or folded into the message before it.
            if has_later_system(list(conv)) and not renders_system_in_place(lambda probe: text_of(probe, False, None)):
                conv = fold_system(list(conv))
            text, ids = render(conv, add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
            marks.append(message_ends(conv, ids, lambda head: render(head, False)[1])
                         if self.engine.core.kv.checkpointing else ())
        return self._generate(prompts, sampling_params, use_tqdm, None, marks)

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        """Step until every request is done. The bar counts finished prompts and, after every step, the
        prompt and output tokens per second so far, so a long prefill visibly moves (vLLM's format)."""
        finished: dict[str, RequestOutput] = {}
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        stats, start = self.stats, time.perf_counter()
        prompt0, output0 = stats.prompt_tokens, stats.generation_tokens
        while self.engine.has_unfinished_requests():
            done = 0
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    done += 1
            if use_tqdm:
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"est. speed input: {(stats.prompt_tokens - prompt0) / elapsed:.2f} toks/s, "
                                    f"output: {(stats.generation_tokens - output0) / elapsed:.2f} toks/s",
                                    refresh=False)
                bar.update(done)  # refreshes at most every mininterval, with or without a finished prompt
        bar.close()
        return [finished[rid] for rid in request_ids]
