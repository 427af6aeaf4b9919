"""How one step's budget is shared between prefills, so a long prompt never blocks short ones.

vLLM's names: at most `max_num_partial_prefills` requests prefill in one step, at most
`max_long_partial_prefills` of them long, where a prefill is long while it has more than
`long_prefill_token_threshold` tokens left. A waiting long prompt that would exceed the long cap is passed
over (the short ones behind it start); it starts once a long prefill ahead of it is no longer long. Within a
step the prefills share what the decodes left max-min fairly: the shortest demands are met first and the rest
goes to the longest, so a 16-token prompt beside a 30K-token one costs the long prompt 16 tokens of that step,
and a long prefill keeps at least 1/max_num_partial_prefills of it however many short prompts arrive.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ladle.config.engine_args import EngineArgs
    from ladle.config.provenance import Provenance

logger = logging.getLogger("ladle")
DEFAULT_PARTIAL_PREFILLS = 4


@dataclass(frozen=True)
class PartialPrefillLimits:
    max_num_partial_prefills: int
    max_long_partial_prefills: int
    long_prefill_token_threshold: int

    def is_long(self, tokens_left: int) -> bool:
        return tokens_left > self.long_prefill_token_threshold


def default_limits(max_num_seqs: int, budget: int) -> PartialPrefillLimits:
    """What resolve_partial_prefills derives when nothing is set."""
    return PartialPrefillLimits(min(DEFAULT_PARTIAL_PREFILLS, max_num_seqs), 1, budget)


def resolve_partial_prefills(args: EngineArgs, prov: Provenance, budget: int) -> PartialPrefillLimits:
    """The three settings, explicit values kept; derived ones from the step budget and max_num_seqs."""
    defaults = default_limits(args.max_num_seqs, budget)
    num, long = args.max_num_partial_prefills, args.max_long_partial_prefills
    if num is not None:
        prov.put("max_num_partial_prefills", num)
    elif long is not None and long > defaults.max_num_partial_prefills:
        num = prov.put("max_num_partial_prefills", long, "raised to the explicit max_long_partial_prefills")
    else:
        num = prov.put("max_num_partial_prefills", defaults.max_num_partial_prefills,
                       f"min({DEFAULT_PARTIAL_PREFILLS}, max_num_seqs): short prompts start beside a long prefill, "
                       f"which keeps at least 1/{DEFAULT_PARTIAL_PREFILLS} of the step")
    if long is not None:  # never above num: EngineArgs.validate checked two explicit values
        prov.put("max_long_partial_prefills", long)
    else:
        long = prov.put("max_long_partial_prefills", defaults.max_long_partial_prefills,
                        "one long prefill at a time: the other slots stay free for short prompts")
    threshold = args.long_prefill_token_threshold
    if threshold is None:
        threshold = prov.put("long_prefill_token_threshold", defaults.long_prefill_token_threshold,
                             "max_num_batched_tokens: a prompt that cannot prefill within one step is long")
    else:
        prov.put("long_prefill_token_threshold", threshold)
        if "max_prefill_length" not in prov.explicit:
            logger.info("long_prefill_token_threshold=%d says what counts as long; it no longer caps a chunk "
                        "(it did before partial prefills existed): set max_prefill_length for that", threshold)
    return PartialPrefillLimits(num, long, threshold)
