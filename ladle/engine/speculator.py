"""Drafts for the decode rows of a step (speculative decoding): proposed, gated by what they are expected to
pay (ladle.engine.spec_gate), and counted once verified. The runner verifies them in the same step as
everything else (ladle.runner.spec_verify), so the tokens a request gets are those it would get without them.

A row drafts only where verification is exact as built: not under penalties (their counts would need every
draft position's tokens) or a grammar (its mask per draft position); those rows decode as usual.
"""
from __future__ import annotations

from ladle.engine.ngram_proposer import NgramProposer
from ladle.engine.spec_gate import SpecGate
from ladle.engine.stats import EngineStats
from ladle.request import Request
from ladle.runner.sampling_batch import penalized
from ladle.speculative_config import SpeculativeConfig


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, stats: EngineStats) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = stats
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.gate = SpecGate()

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.sampling_params
        return p.structured_outputs is None and not penalized(p)

    def drafts(self, decodes: list[Request], budget: int) -> dict[str, tuple[int, ...]]:
        """Each drafting row's drafts, within the step's token budget (each decode row's own token first)."""
        off = self.config.disable_by_batch_size
        if (off is not None and len(decodes) > off) or self.gate.plain_step():
            return {}
        out: dict[str, tuple[int, ...]] = {}
        left = budget - len(decodes)
        for req in decodes:
            if left <= 0:
                break
            # Never past max_tokens or max_model_len: the row's own token comes after its drafts.
            k = min(self.config.num_speculative_tokens, left, req.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
            if k <= 0 or not self.eligible(req):
                continue
            drafts = self.proposer.propose(req.request_id, req.all_token_ids, k)
            take = self.gate.allows(req.request_id, len(drafts), len(decodes)) if drafts else 0
            if take:
                out[req.request_id] = drafts[:take]
                left -= take
        return out

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        self.gate.record(request_id, drafted, accepted)
        self.stats.spec_decode_num_drafts += 1
        self.stats.spec_decode_num_draft_tokens += drafted
        self.stats.spec_decode_num_accepted_tokens += accepted

    def record_step(self, num_tokens: int, ms: float) -> None:
        self.gate.record_step(num_tokens, ms)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.gate.forget(request_id)
