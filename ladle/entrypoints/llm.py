"""Offline batch generation, shaped like vLLM's LLM: every prompt goes through the one engine core."""
from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from ladle.engine.llm_engine import LLMEngine, PromptType
from ladle.engine.stats import EngineStats
from ladle.outputs import RequestOutput
from ladle.sampling_params import SamplingParams

Conversation = list[dict[str, str]]


class LLM:
    """LLM(model=DIR, **engine_args); the engine args are those of ladle.config.EngineArgs."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine.from_kwargs(model=model, **engine_args)
        self._next_id = 0

    @property
    def config(self):
        return self.engine.core.config

    @property
    def stats(self) -> EngineStats:
        return self.engine.core.stats

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt. All prompts are checked before any work starts: if one can never fit
        (prompt + max_tokens > max_model_len, or more KV than the whole pool), the call raises ValueError
        naming that prompt and runs nothing."""
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
        pending = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            text, ids = self.engine.tokenize(prompt)
            rid = str(self._next_id + i)
            try:
                reqs = self.engine.make_requests(rid, ids, params)
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
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages is empty; give at least one message")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[rid] for rid in request_ids]
