"""Turns core outputs into RequestOutputs: each child's output through ChildState (the server's streams use
the same), n > 1 children folded into one RequestOutput."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ladle.engine.core_output import EngineCoreOutput
from ladle.frontend.child_state import ChildState, child_states
from ladle.frontend.detokenizer import decode_logprobs
from ladle.outputs import CompletionOutput, RequestOutput
from ladle.sampling_params import SamplingParams

logger = logging.getLogger("ladle")


@dataclass(kw_only=True)
class _Child(ChildState):
    parent_id: str = ""


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, RequestOutput] = {}
        self.children: dict[str, _Child] = {}

    def add(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        child_ids: list[str],
    ) -> None:
        out = RequestOutput(request_id, prompt, prompt_token_ids)
        for child in child_states(_Child, self.tokenizer, child_ids, [prompt_token_ids], params):
            child.parent_id = request_id
            self.children[child.child_id] = child
            out.outputs.append(CompletionOutput(child.index, "", [], [] if params.logprobs is not None else None))
        self.parents[request_id] = out

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs touched (finished ones leave the processor) and child ids to abort."""
        touched: dict[str, RequestOutput] = {}
        to_abort: list[str] = []
        for co in core_outputs:
            child = self.children.get(co.request_id)
            if child is None:
                continue
            parent = self.parents[child.parent_id]
            comp = parent.outputs[child.index]
            try:
                self._apply(co, child, comp, parent, to_abort)
            except Exception as e:  # noqa: BLE001 -- a detokenizer or stop-string error ends this child only
                logger.error("detokenizing request %s failed; ending it", co.request_id, exc_info=e)
                if co.finish_reason is None:
                    to_abort.append(co.request_id)
                comp.finish_reason = "error"
                parent.error = f"detokenizing request {co.request_id} failed ({type(e).__name__})"
                self.children.pop(co.request_id, None)
            comp.text = child.detok.output_text
            touched[parent.request_id] = parent
        for rid, parent in touched.items():
            if all(c.finish_reason is not None for c in parent.outputs):
                parent.finished = True
                del self.parents[rid]
        return list(touched.values()), to_abort

    def _apply(self, co: EngineCoreOutput, child: _Child, comp: CompletionOutput, parent: RequestOutput,
               to_abort: list[str]) -> None:
        comp.token_ids.extend(co.new_token_ids)
        if co.prefill_chunks is not None:
            comp.prefill_chunks = co.prefill_chunks
        if co.num_cached_tokens is not None:  # children share the prompt; a later one may find more cached
            parent.num_cached_tokens = max(parent.num_cached_tokens, co.num_cached_tokens)
        if comp.logprobs is not None:
            comp.logprobs.extend(decode_logprobs(self.tokenizer, lp) for lp in co.new_logprobs)
        if co.prompt_logprobs is not None and parent.prompt_logprobs is None:  # n > 1: every child has them
            parent.prompt_logprobs = [None if lp is None else decode_logprobs(self.tokenizer, lp)
                                      for lp in co.prompt_logprobs]
        if child.apply(co):
            to_abort.append(co.request_id)
        if co.error is not None:
            parent.error = co.error
        if child.finish_reason is not None:
            comp.finish_reason, comp.stop_reason = child.finish_reason, child.stop_reason
            del self.children[co.request_id]
