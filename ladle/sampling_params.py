"""SamplingParams, shaped like vLLM's so its users feel at home."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, replace


class InvalidSamplingParam(ValueError):
    """A sampling parameter out of its range; `field` names it (as vLLM and OpenAI spell it)."""

    def __init__(self, field: str, rule: str, value: object) -> None:
        super().__init__(f"SamplingParams.{field} {rule}, got {value!r}")
        self.field, self.rule, self.value = field, rule, value


def as_float32(x: float) -> float:
    """x as the sampler's float32 tensors hold it: 5e-324 becomes 0.0, 1e39 becomes inf."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class ThinkTags:
    """A reasoning model's thinking-block delimiters as token ids. A frontend with a reasoning parser sets them on
    a request's StructuredOutputsParams, so the constraint applies only once the thinking block has ended."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    # Where the request starts: "thinking" (the prompt left a block open), "may_open" (its first token may open
    # one), "enforced" (no block: the template closed this turn's); None reads it from the prompt's tokens.
    initial: str | None = None

    def __post_init__(self) -> None:
        if not self.start or not self.end or not all(isinstance(t, int) and t >= 0 for t in self.start + self.end):
            raise InvalidSamplingParam("structured_outputs.think_tags", "must hold two non-empty token-id tuples",
                                       self)
        if self.initial not in (None, "thinking", "may_open", "enforced"):
            raise InvalidSamplingParam("structured_outputs.think_tags.initial",
                                       "must be thinking, may_open, enforced or None", self.initial)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's StructuredOutputsParams): exactly one of a JSON schema (a dict
    or its JSON text), a regex, a choice of strings, a Lark or GBNF grammar, or any JSON object. Enforced on
    every token by ladle.structured_output; each is checked (and its grammar validated) before the request runs.

    JSON whitespace: by default at most 20 whitespace characters between two JSON tokens (bounded, so a model
    cannot emit whitespace forever); disable_any_whitespace allows none, whitespace_pattern sets the regex."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # every object of the schema gets additionalProperties: false
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # accepted: ladle has one backend (llguidance) and never falls back
    # Set by a frontend with a reasoning parser: the output may open with a thinking block (or the prompt left
    # one open), unconstrained but for EOS; the constraint starts after its end tag.
    think_tags: ThinkTags | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in _CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidSamplingParam("structured_outputs", f"must set exactly one of {', '.join(_CONSTRAINTS)} "
                                       f"(set: {', '.join(set_) or 'none'})", self)
        kinds: dict[str, type | tuple[type, ...]] = {"json": (str, dict), "regex": str, "choice": list, "grammar": str,
                                                     "json_object": bool}
        value = getattr(self, set_[0])
        if not isinstance(value, kinds[set_[0]]):
            raise InvalidSamplingParam(f"structured_outputs.{set_[0]}", "has the wrong type", value)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidSamplingParam("structured_outputs.choice", "must be a non-empty list of strings",
                                       self.choice)
        if self.think_tags is not None and not isinstance(self.think_tags, ThinkTags):
            raise InvalidSamplingParam("structured_outputs.think_tags", "must be a ThinkTags", self.think_tags)
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise InvalidSamplingParam("structured_outputs.whitespace_pattern",
                                       "contradicts disable_any_whitespace; set one", self.whitespace_pattern)
        for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidSamplingParam(f"structured_outputs.{flag}", "must be a bool", getattr(self, flag))

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        return next(k for k in _CONSTRAINTS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    # Per prompt token after the first: its logprob, rank and the top-N (RequestOutput.prompt_logprobs). The
    # request then reads nothing from the prefix cache for its prompt, as in vLLM: cached tokens have no logits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    priority: int = 0  # with scheduling_policy="priority": lower values are served first (vLLM semantics)
    structured_outputs: StructuredOutputsParams | None = None  # the output must match this (a grammar)
    # Speculative decoding: at most this many drafts a step for this request (0: none, opting out); None: as
    # many as the engine's speculative_config drafts. The tokens are the same either way; only the speed differs.
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    @property
    def stop_list(self) -> list[str]:
        """stop as __post_init__ leaves it: always a list."""
        assert isinstance(self.stop, list)
        return self.stop

    def _verify(self) -> None:
        def bad(name: str, rule: str) -> InvalidSamplingParam:
            return InvalidSamplingParam(name, rule, getattr(self, name))

        # Every float must survive float32 as a finite number: the sampler computes in float32, and a NaN or
        # inf there (or a 0 where 0 divides) poisons the whole row's distribution.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "must be a number")
            if not math.isfinite(as_float32(value)):
                raise bad(name, "must be a finite number (within float32 range)")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0 or as_float32(self.top_p) == 0.0:
            raise bad("top_p", "must be in (0, 1] and not round to 0 in float32")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0 or as_float32(self.repetition_penalty) == 0.0:
            raise bad("repetition_penalty", "must be > 0 and not round to 0 in float32")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 or None")
        k = self.prompt_logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            # vLLM's -1 (the whole vocabulary) is refused as for logprobs: a Logprob per vocabulary entry per
            # prompt token is rarely what a client can hold.
            raise bad("prompt_logprobs", "must be an integer >= 0 or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop_list):
            raise bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold token ids >= 0")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or None")
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise bad("num_speculative_tokens", "must be an integer >= 0 (0: no drafts for this request) or None")
        priority = self.priority
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**63) <= priority < 2**63:
            raise bad("priority", "must be an integer in [-2**63, 2**63)")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "must be an integer in [-2**63, 2**64)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of n parallel samples: n=1, and a distinct seed so samples differ."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed >= 2**64:
            seed -= 2**64  # wrap, as a uint64 seed would
        return replace(self, n=1, seed=seed)
