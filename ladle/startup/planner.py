"""The memory plan: weights + KV pool + the activation peak of one full step at the worst-case context +
margin must fit the budget, decided at startup so a request can never discover it mid-prefill.

Explicit settings are honoured or refused with the largest value that fits; only unset ones are derived.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ladle.config.sizes import format_bytes
from ladle.kv_cache.specs import blocks_held
from ladle.startup.profiling import ActivationModel

MiB = 2**20
STEP = 64  # derived budgets are multiples of 64: matrix tiles fall off cliffs between them
MAX_DERIVED_TOKENS = 8192
CPU_DEFAULT_KV_CAP = 512 * MiB  # zero-filling a pool of most of RAM costs seconds at every start on CPU


@dataclass(frozen=True)
class PlanInputs:
    budget: int
    budget_reason: str
    weights: int
    kv_bytes_per_token: int
    block_size: int
    model_max_len: int
    max_num_seqs: int
    on_cpu: bool
    activation: ActivationModel
    graph_bytes: int = 0  # the CUDA graphs' private memory pool, held apart from eager steps' activations
    windows: tuple[int | None, ...] = (None,)  # each KV cache group's sliding window (None: full attention)
    state_bytes: int = 0  # state layers' slots, one per running request (max_num_seqs x bytes per request)
    state_draft_positions: int = 0  # speculative decoding: more state rows per running request, one per draft
    compressions: tuple[tuple[int, int], ...] = ()  # each group's (tokens per entry, block scale); () all (1, 1)
    penalty_bytes: int = 0  # the sampler's penalty counts: a vocabulary-wide row per running request
    num_checkpoints: int = 0  # state checkpoints for prefix hits (models with per-request state)
    checkpoint_bytes: int = 0  # each
    weights_format: str = ""  # what the weight bytes are, where not all the model dtype (quantized checkpoints)
    tiered: str = ""  # MoE routed experts off the device: where, and the slots that cache them
    tables: str = ""  # embedding tables held apart from the other weights (Qwen4-Exp's PLE): where, and their bytes

    @property
    def reserved(self) -> int:
        """Held for good beside the KV pool: CUDA graphs' pool, the state slots and checkpoints, and the penalty
        counts."""
        return (self.graph_bytes + self.state_bytes + self.penalty_bytes
                + self.num_checkpoints * self.checkpoint_bytes)

    @property
    def margin(self) -> int:
        return max(8 * MiB, self.budget // 20)

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def request_blocks(self, max_model_len: int, tokens: int) -> int:
        """Blocks one max_model_len request holds at most, over all groups, prefilled `tokens` at a time."""
        compressions = self.compressions or ((1, 1),) * len(self.windows)
        return sum(blocks_held(w, max_model_len, self.block_size, tokens, c)
                   for w, c in zip(self.windows, compressions))

    def room(self) -> int:
        """Bytes left for KV pool and activations."""
        return self.budget - self.weights - self.margin - self.reserved

    def fits(self, tokens: int, max_model_len: int, kv_blocks: int | None = None) -> bool:
        blocks = self.request_blocks(max_model_len, tokens) if kv_blocks is None else kv_blocks
        return self.activation.predict(tokens, max_model_len) + blocks * self.block_bytes <= self.room()

    def need(self, tokens: int, max_model_len: int, kv_blocks: int | None = None) -> int:
        blocks = self.request_blocks(max_model_len, tokens) if kv_blocks is None else kv_blocks
        return (self.weights + self.margin + self.reserved + self.activation.predict(tokens, max_model_len)
                + blocks * self.block_bytes)

    def largest_tokens(self, max_model_len: int, kv_blocks: int | None = None, step: int = STEP) -> int:
        """Largest multiple of `step` (up to MAX_DERIVED_TOKENS) whose step fits; 0 if none does."""
        t = MAX_DERIVED_TOKENS
        while t >= step and not self.fits(t, max_model_len, kv_blocks):
            t -= step
        return t if t >= step else 0

    def largest_fitting(self, below: int, max_model_len: int) -> int:
        """The exact largest step size under `below` that fits (0 if none): a binary search over the whole
        range, since a refused explicit value may be far above the cap derived values stop at."""
        lo, hi = 0, below - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(mid, max_model_len):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def largest_model_len(self, tokens: int) -> int:
        """Largest context, in whole blocks, for which one request's KV fits beside a step of `tokens`."""
        lo, hi = 0, self.blocks_for(self.model_max_len)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(tokens, mid * self.block_size):
                lo = mid
            else:
                hi = mid - 1
        return min(lo * self.block_size, self.model_max_len)


@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    max_model_len: int
    max_num_batched_tokens: int
    max_prefill_length: int
    num_kv_blocks: int
    ranks: tuple[str, ...] = ()  # tensor parallel: each rank's own plan, before they agreed on the smallest

    @property
    def activation_peak(self) -> int:
        return self.inputs.activation.predict(self.max_num_batched_tokens, self.max_model_len)

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_kv_blocks * self.inputs.block_bytes

    @property
    def headroom(self) -> int:
        i = self.inputs
        return i.budget - i.weights - self.kv_pool_bytes - self.activation_peak - i.margin - i.reserved

    def lines(self) -> list[str]:
        i = self.inputs
        graphs = [f"cuda graphs       {i.graph_bytes / MiB:10.1f} MiB  (predicted: the largest captured decode step)"]
        return [
            f"memory budget     {i.budget / MiB:10.1f} MiB  ({i.budget_reason})",
            f"weights           {i.weights / MiB:10.1f} MiB" + (f"  ({i.weights_format})" if i.weights_format else ""),
            *([f"                              {i.tiered}"] if i.tiered else []),
            *([f"                              {i.tables}"] if i.tables else []),
            f"KV pool           {self.kv_pool_bytes / MiB:10.1f} MiB  ({self.num_kv_blocks} blocks x "
            f"{i.block_size} = {self.num_kv_blocks * i.block_size} tokens, {i.kv_bytes_per_token} B/token)",
            f"activation peak   {self.activation_peak / MiB:10.1f} MiB  (predicted: a step of "
            f"{self.max_num_batched_tokens} tokens at context {self.max_model_len})",
            *(graphs if i.graph_bytes else []),
            *([f"state slots       {i.state_bytes / MiB:10.1f} MiB  ({i.max_num_seqs} slots, one per running "
               f"request, {format_bytes(i.state_bytes // i.max_num_seqs // (1 + i.state_draft_positions))} each"
               + (f"; and {i.state_draft_positions} per request for the states after its drafts"
                  if i.state_draft_positions else "") + ")"] if i.state_bytes else []),
            *([f"state checkpoints {i.num_checkpoints * i.checkpoint_bytes / MiB:10.1f} MiB  ({i.num_checkpoints} x "
               f"{format_bytes(i.checkpoint_bytes)}, for prefix hits)"] if i.num_checkpoints else []),
            *([f"penalty counts    {i.penalty_bytes / MiB:10.1f} MiB  ({i.max_num_seqs} rows of the vocabulary, "
               "allocated when a request with a penalty arrives)"] if i.penalty_bytes else []),
            f"margin            {i.margin / MiB:10.1f} MiB",
            f"headroom          {self.headroom / MiB:10.1f} MiB",
            f"activation model  {i.activation.describe()}",
            *(["tensor-parallel ranks, each planned on its own (the engine runs the smallest of each figure):"]
              + [f"  {line}" for line in self.ranks] if self.ranks else []),
        ]

    def summary(self) -> str:
        """One line: this plan's main figures."""
        i = self.inputs
        return (f"budget {i.budget / MiB:.1f} MiB, weights {i.weights / MiB:.1f} MiB, KV pool "
                f"{self.num_kv_blocks} blocks ({self.kv_pool_bytes / MiB:.1f} MiB), step "
                f"{self.max_num_batched_tokens} tokens (activation peak {self.activation_peak / MiB:.1f} MiB), "
                f"headroom {self.headroom / MiB:.1f} MiB")

    def prompt_report(self, prompt_tokens: int) -> str:
        if prompt_tokens > self.max_model_len:
            return (f"a {prompt_tokens}-token prompt does not fit: max_model_len is {self.max_model_len}; it "
                    "would be rejected at submission with context_length_exceeded")
        if self.inputs.request_blocks(prompt_tokens, self.max_prefill_length) > self.num_kv_blocks:
            return f"a {prompt_tokens}-token prompt needs more KV blocks than the pool has; it would be rejected"
        chunk = min(self.max_prefill_length, self.max_num_batched_tokens)
        chunks = -(-prompt_tokens // chunk)
        # The last chunk sees the longest context; workspace is flat past one tile, so it is the peak.
        peak = self.inputs.activation.predict_prefill(min(chunk, prompt_tokens), prompt_tokens)
        return (f"a {prompt_tokens}-token prompt fits: {chunks} chunk(s) of at most {chunk} tokens, predicted "
                f"activation peak {peak / MiB:.1f} MiB (a lone request; the plan budgets "
                f"{self.activation_peak / MiB:.1f} MiB for the fullest step)")


def _fail(flag: str, value: int | str, need: int, room: int, largest: int | str) -> ValueError:
    return ValueError(
        f"{flag}={value} does not fit: it needs {format_bytes(need)} (weights + KV for one max_model_len "
        f"request + activations + margin) but the memory budget is {format_bytes(room)}; the largest "
        f"{flag} that fits is {largest}"
    )


def plan_memory(
    inputs: PlanInputs, explicit: dict[str, int], put: Callable[[str, int, str], int]
) -> MemoryPlan:
    """Decide max_model_len, max_num_batched_tokens, max_prefill_length and num_kv_blocks.

    explicit holds the values the user typed (by setting name); put(name, value, reason) records each
    decision with its provenance (reason is used only for derived values) and returns the value.
    """
    budget_t, chunk_t = explicit.get("max_num_batched_tokens"), explicit.get("max_prefill_length")
    # The context is derived down only when even the smallest step leaves no room for it; an explicit step
    # too large beside the full context is refused below rather than silently shrinking the context.
    probe = STEP
    if "max_model_len" in explicit:
        max_len = explicit["max_model_len"]
        if not inputs.fits(probe, max_len):
            raise _fail("max_model_len", max_len, inputs.need(probe, max_len), inputs.budget,
                        inputs.largest_model_len(probe))
        put("max_model_len", max_len, "")
    else:
        max_len = inputs.model_max_len
        reason = "the model's max_position_embeddings"
        if not inputs.fits(probe, max_len):
            max_len = inputs.largest_model_len(probe)
            if max_len < inputs.block_size:
                raise ValueError(
                    f"the model does not fit: weights {inputs.weights / MiB:.1f} MiB + a step of {probe} tokens "
                    f"+ margin leave no room for KV in a {inputs.budget / MiB:.1f} MiB budget "
                    f"({inputs.budget_reason}); raise memory_budget or use a smaller model")
            reason = (f"the model's {inputs.model_max_len}-token context does not fit in memory; "
                      f"{max_len} is the largest that does")
        put("max_model_len", max_len, reason)

    largest = inputs.largest_tokens(max_len)
    if budget_t is not None:
        if not inputs.fits(budget_t, max_len):
            raise _fail("max_num_batched_tokens", budget_t, inputs.need(budget_t, max_len), inputs.budget,
                        inputs.largest_fitting(budget_t, max_len))
        tokens = put("max_num_batched_tokens", budget_t, "")
    else:
        if chunk_t is not None and not inputs.fits(chunk_t, max_len):
            raise _fail("max_prefill_length", chunk_t, inputs.need(chunk_t, max_len), inputs.budget,
                        inputs.largest_fitting(chunk_t, max_len))
        tokens = max(largest, chunk_t or 0)
        put("max_num_batched_tokens", tokens,
            f"largest multiple of {STEP} (at most {MAX_DERIVED_TOKENS}) whose step peak fits beside one "
            f"max_model_len request" + (", raised to the explicit max_prefill_length" if tokens != largest else ""))
    chunk = put("max_prefill_length", chunk_t, "") if chunk_t is not None else put(
        "max_prefill_length", tokens, "the step budget: one request may fill a step")

    fixed = inputs.weights + inputs.margin + inputs.reserved + inputs.activation.predict(tokens, max_len)
    most = max(0, (inputs.budget - fixed) // inputs.block_bytes)
    if "num_kv_blocks" in explicit:
        blocks = explicit["num_kv_blocks"]
        if blocks > most:
            raise _fail("num_kv_blocks", blocks, fixed + blocks * inputs.block_bytes, inputs.budget, most)
        put("num_kv_blocks", blocks, "")
    elif "kv_cache_memory_bytes" in explicit:
        kv_bytes = explicit["kv_cache_memory_bytes"]
        if kv_bytes // inputs.block_bytes > most:
            raise _fail("kv_cache_memory_bytes", format_bytes(kv_bytes), fixed + kv_bytes, inputs.budget,
                        format_bytes(most * inputs.block_bytes))
        blocks = put("num_kv_blocks", kv_bytes // inputs.block_bytes, "kv_cache_memory_bytes / bytes per block")
    else:
        blocks, why = most, "what the budget leaves after weights, the step's activation peak and margin"
        if inputs.on_cpu:
            cap = max(CPU_DEFAULT_KV_CAP // inputs.block_bytes, inputs.request_blocks(max_len, tokens))
            if cap < blocks:
                why = f"capped at {CPU_DEFAULT_KV_CAP // MiB} MiB on CPU (set kv_cache_memory_bytes for more)"
                blocks = cap
        put("num_kv_blocks", blocks, why)
    return MemoryPlan(inputs, max_len, tokens, chunk, blocks)
