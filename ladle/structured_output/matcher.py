"""Building llguidance matchers: the tokenizer as llguidance sees it, and a grammar's matcher checked at its first
mask. The engine and the sandbox's workers build both the same way, so a grammar that compiled in a worker
compiles in the engine (the crash or the cost a worker met, the engine would have met)."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer


class GrammarError(RuntimeError):
    """llguidance could not build a matcher for a grammar (its message says why)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What llguidance needs of a tokenizer, as plain data a worker process can be sent."""
    json: str  # tokenizer.json's text, plain added tokens moved into the BPE vocabulary (see tokenizer_spec)
    n_vocab: int  # the logits' width
    eos: tuple[int, ...]


def tokenizer_spec(hf: Any, vocab_size: int, eos: list[int] | tuple[int, ...]) -> TokenizerSpec:
    """llguidance's view of a fast HF tokenizer. llguidance reads every added token as special (a grammar's text
    never matches it), but a plain added token (special: false, as Qwen's <tool_call> and <think> are) is text
    the model writes: it joins the BPE vocabulary here, so a grammar's "<tool_call>" matches it."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("structured outputs need a fast tokenizer (tokenizer.json)")
    if len(hf) > vocab_size:
        raise GrammarError(f"the tokenizer has {len(hf)} tokens, more than the model's {vocab_size} logits: "
                           "structured outputs cannot map its tokens")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    if spec.get("model", {}).get("type") == "BPE":
        plain = [t for t in spec.get("added_tokens", []) if not t.get("special")]
        spec["model"]["vocab"].update({t["content"]: t["id"] for t in plain})
        spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t.get("special")]
    return TokenizerSpec(json.dumps(spec), vocab_size, tuple(eos))


def lltokenizer(spec: TokenizerSpec) -> LLTokenizer:
    import llguidance

    return llguidance.LLTokenizer(spec.json, n_vocab=spec.n_vocab, eos_token=list(spec.eos) or None)


def compile_matcher(tokenizer: LLTokenizer, grammar: str) -> LLMatcher:
    """The pristine matcher of grammar; raises GrammarError where it cannot be built, or where no text can start
    it (a regex matching nothing fails only at its first mask, so a probe computes one)."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    for m in (matcher, probe):
        if m.is_error():
            raise GrammarError(error_line(m.get_error()))
    return matcher


# llguidance's stop reasons that name no error of their own, said for a client.
_STOP_REASONS = {"NoExtensionBias": "no token can start it: no text satisfies this grammar"}


def error_line(report: str | None) -> str:
    """A matcher's error in one line. llguidance reports its stop reason, then its state and the whole grammar
    (megabytes for a big one); the "Error:" line, or the stop reason said plainly, is what a client needs."""
    lines = [line.strip() for line in (report or "").splitlines() if line.strip()]
    said = next((line.removeprefix("Error:").strip() for line in lines if line.startswith("Error:")), "None")
    if said != "None":
        return said
    first = lines[0] if lines else ""
    return _STOP_REASONS.get(first, first or "the grammar entered an error state")
