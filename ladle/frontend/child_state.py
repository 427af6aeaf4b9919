"""One engine request's output as a frontend sees it, the same offline and served: its text detokenized as
tokens come, stop strings found, and its finish settled.

Stop strings are text, so they are found here, not in the core: when one ends a child the core would go on
with, apply() says so and the frontend aborts the child in the core.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from ladle.engine.core_output import EngineCoreOutput
from ladle.frontend.detokenizer import IncrementalDetokenizer
from ladle.frontend.stop_strings import StopMatcher
from ladle.sampling_params import SamplingParams


@dataclass(kw_only=True)
class ChildState:
    child_id: str
    index: int  # among the user request's children (prompt-major)
    prompt_index: int
    detok: IncrementalDetokenizer
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def apply(self, out: EngineCoreOutput) -> bool:
        """Take one core output of this child; True when a stop string ended it and the core must abort it."""
        stop_str = self.detok.update(out.new_token_ids, stop_terminated=out.stop_token)
        abort = False
        if stop_str is not None:
            abort = out.finish_reason is None
            self.finish_reason, self.stop_reason = "stop", stop_str
        elif out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if self.finish_reason is not None:
            self.detok.finish()
        return abort


C = TypeVar("C", bound=ChildState)


def child_states(cls: type[C], tokenizer: Any, child_ids: list[str], prompts: list[list[int]],
                 params: SamplingParams) -> list[C]:
    """The states of a user request's children (params.n per prompt, ids from child_request_ids), sharing one
    stop-string matcher; cls: ChildState or a frontend's subclass of it."""
    stop = StopMatcher(params.stop_list)
    return [cls(child_id=cid, index=i, prompt_index=i // params.n, detok=IncrementalDetokenizer(
                tokenizer, prompts[i // params.n], stop, params.include_stop_str_in_output,
                params.skip_special_tokens, min_tokens=params.min_tokens))
            for i, cid in enumerate(child_ids)]
