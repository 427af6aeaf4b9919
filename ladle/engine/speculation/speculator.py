"""Drafts for the decode rows of a step (speculative decoding): proposed, gated by what they are expected to
pay (ladle.engine.speculation.gate), and counted once verified. The runner verifies them in the same step as
everything else (ladle.runner.spec_verify), so the tokens a request gets are those it would get without them.

Penalties count each position's earlier drafts (ladle.runner.spec_verify); a constrained row gets the grammar's
mask at each of its positions (ladle.engine.structured_step.draft_masks), and drafts what the grammar forces
where it forces something (a JSON key, the punctuation around it): masked sampling can take nothing else, so
those drafts are accepted. A row drafts nothing while a thinking block may still open or holds the grammar
(no rollback crosses its end).
"""
from __future__ import annotations

from ladle.config.speculative import SpeculativeConfig
from ladle.engine.speculation.arms import StepArms
from ladle.engine.speculation.gate import SpecGate
from ladle.engine.speculation.ngram_proposer import NgramProposer
from ladle.engine.stats import EngineStats
from ladle.request import Request
from ladle.structured_output.manager import StructuredOutputManager


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, stats: EngineStats,
                 grammars: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.grammars = grammars
        self.max_model_len = max_model_len
        self.stats = stats
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.method == "ngram" else None
        self.gate = SpecGate()
        self.arms = StepArms()

    def _propose(self, req: Request, k: int) -> tuple[int, ...]:
        """The row's drafts: a constrained row's forced tokens where its grammar forces any, else n-gram lookup
        (none while its grammar cannot take drafts back)."""
        rid = req.request_id
        if req.sampling_params.structured_outputs is not None:
            if self.grammars is None or not self.grammars.can_draft(rid):
                return ()
            forced = self.grammars.forced_tokens(rid)
            if forced:
                return tuple(forced[:k])
        if self.proposer is None:  # mtp: the drafts the runner made with the request's last token
            return req.spec_token_ids[:k]
        return self.proposer.propose(rid, req.all_token_ids, k)

    def _cap(self, req: Request, left: int) -> int:
        """The most drafts the row may carry: never past max_tokens or max_model_len (the row's own token comes
        after its drafts), nor more than the request allows (its opt-out: num_speculative_tokens 0)."""
        own = req.sampling_params.num_speculative_tokens
        return min(self.config.num_speculative_tokens if own is None else own, self.config.num_speculative_tokens,
                   left, req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)

    def _off(self, rows: int) -> bool:
        off = self.config.disable_by_batch_size
        return (off is not None and rows > off) or not self.arms.drafts_now(rows)

    def _settled_off(self, rows: int) -> bool:
        """Steps of this many rows draft nothing for the foreseeable future."""
        off = self.config.disable_by_batch_size
        return (off is not None and rows > off) or self.arms.settled_plain(rows)

    def drafts(self, decodes: list[Request], budget: int) -> dict[str, tuple[int, ...]]:
        """Each drafting row's drafts, within the step's token budget (each decode row's own token first). The
        model's own drafts (mtp) were gated when the step before asked for them (proposals)."""
        mtp = self.proposer is None
        if not mtp and self._off(len(decodes)):
            return {}
        out: dict[str, tuple[int, ...]] = {}
        left = budget - len(decodes)
        for req in decodes:
            if left <= 0:
                break
            k = self._cap(req, left)
            if k <= 0:
                continue
            drafts = self._propose(req, k)
            if mtp or not drafts:  # the model's own were gated when asked for
                take = len(drafts)
            else:
                take = self.gate.allows(req.request_id, len(drafts), len(decodes))
            if take:
                out[req.request_id] = drafts[:take]
                left -= take
        return out

    def proposals(self, sampled: list[Request]) -> dict[str, int] | None:
        """mtp: how many drafts the runner's MTP layer is to make after each of these rows' sampled token, for
        the step after. Gated here, as making them costs the step that samples. None: the MTP layer rests this
        step, its cache not written either, as drafts have not paid at this batch size for a while (a request
        that drafts later reads a cache with holes there: fewer drafts accepted, the same tokens)."""
        if self.proposer is not None or not sampled:
            return {}
        if self._off(len(sampled)):
            return None if self._settled_off(len(sampled)) else {}
        out = {}
        for req in sampled:
            k = self._cap(req, self.config.num_speculative_tokens)
            take = self.gate.allows(req.request_id, k, len(sampled)) if k > 0 else 0
            if take:
                out[req.request_id] = take
        return out

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        self.gate.record(request_id, drafted, accepted)
        self.stats.spec_decode_num_drafts += 1
        self.stats.spec_decode_num_draft_tokens += drafted
        self.stats.spec_decode_num_accepted_tokens += accepted

    def record_step(self, rows: int, num_tokens: int, num_drafts: int, produced: int, ms: float) -> None:
        """A decode-only step of `rows` rows and num_tokens tokens (num_drafts of them drafts) produced
        `produced` tokens in ms."""
        self.gate.record_step(num_tokens, ms)
        self.arms.record(rows, num_drafts > 0, produced, ms)

    def forget(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.forget(request_id)
        self.gate.forget(request_id)
