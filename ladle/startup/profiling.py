"""Measure the activation peak of real steps (dummy tokens) and fit a model of it.

vLLM's profiling run skips attention, so long-context attention workspace is never measured. Here each
profiled step is the real forward + logits + sampling, at the worst-case context: a chunk of T tokens
attending to L - T cached tokens, and T decodes (up to max_num_seqs) each attending to L tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.attention.groups import attention_groups
from ladle.attention.torch_ref import CONTEXT_TILE
from ladle.kv_cache.specs import KVCacheLayout
from ladle.models.interface import ConfiguredModel, RoutedExperts
from ladle.runner.kv_allocation import allocate_kv_caches
from ladle.runner.model_runner import ModelRunner
from ladle.runner.sampling_batch import SamplingMetadata, sampling_batch
from ladle.runner.step_batch import StepBatch
from ladle.sampling_params import SamplingParams
from ladle.startup.memory import measure_peak

# The costliest sampling path: sorting for top-k/top-p, penalties over prompt and output, top-20 logprobs.
# (The penalty counts themselves are reserved by the plan; a profiled step gathers its rows, as a real one.)
_WORST_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1,
                               presence_penalty=0.5, frequency_penalty=0.5, logprobs=20)


@dataclass(frozen=True)
class ProfilePoint:
    kind: str  # "prefill": one chunk of num_tokens tokens; "decode": num_tokens decodes (sampled rows)
    num_tokens: int
    context: int
    peak: int


def _lstsq(rows: list[list[float]], values: list[float]) -> list[float]:
    """Non-negative least squares by dropping the most negative term and refitting (memory never shrinks
    with more tokens), then the constant raised so that no measured point is under-predicted."""
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(values, dtype=torch.float64)
    active = list(range(1, x.shape[1]))
    while True:
        cols = [0, *active]
        sol = torch.linalg.lstsq(x[:, cols], y[:, None], driver="gelsd").solution[:, 0]
        coef = torch.zeros(x.shape[1], dtype=torch.float64)
        coef[cols] = sol
        negative = [c for c in active if coef[c] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda c: float(coef[c])))
    coef[0] += max(0.0, float((y - x @ coef).max()))
    return [float(v) for v in coef]


@dataclass(frozen=True)
class ActivationModel:
    """Peak bytes of one step of T tokens at context L, beyond weights and KV pool.

    prefill(T, L) = a + b*T + c*T*Lc + d*Lc with Lc = min(L, tile): attention reads context in tiles, so
    its workspace stops growing once the context exceeds one tile. decode(D) = e + f*D for D sampled rows
    (logits, sampling and logprobs are per row; e covers the bounded decode attention workspace); a step
    samples at most min(T, max_num_seqs) rows.
    """

    prefill: tuple[float, float, float, float]
    decode: tuple[float, float]
    tile: int
    max_num_seqs: int
    points: tuple[ProfilePoint, ...]

    def predict_prefill(self, num_tokens: int, context: int) -> int:
        a, b, c, d = self.prefill
        lc = min(context, self.tile)
        return int(max(0.0, a + b * num_tokens + c * num_tokens * lc + d * lc))

    def predict_decode(self, rows: int) -> int:
        e, f = self.decode
        return int(max(0.0, e + f * rows))

    def predict(self, num_tokens: int, context: int) -> int:
        """The worst step of num_tokens tokens: one long chunk, or as many sampled rows as may run."""
        return max(self.predict_prefill(num_tokens, context),
                   self.predict_decode(min(num_tokens, self.max_num_seqs)))

    def describe(self) -> str:
        a, b, c, d = self.prefill
        e, f = self.decode
        return (f"prefill {a / 2**20:.2f} MiB + {b / 1024:.2f} KiB*T + {c:.3f} B*T*Lc + {d:.1f} B*Lc "
                f"(Lc = min(L, {self.tile})); decode {e / 2**20:.2f} MiB + {f / 1024:.1f} KiB*rows "
                f"(rows = min(T, {self.max_num_seqs}))")


def fit_activation_model(points: list[ProfilePoint], max_num_seqs: int, tile: int = CONTEXT_TILE) -> ActivationModel:
    pre = [p for p in points if p.kind == "prefill"]
    dec = [p for p in points if p.kind == "decode"]
    a_d = _lstsq([[1.0, p.num_tokens, p.num_tokens * min(p.context, tile), min(p.context, tile)] for p in pre],
                 [float(p.peak) for p in pre])
    # Per-row sampling cost is the slope between the two largest row counts; the constant covers the
    # bounded decode attention workspace, which dominates at few rows.
    hi, lo = sorted(dec, key=lambda p: (p.num_tokens, p.peak))[-1], sorted(dec, key=lambda p: p.num_tokens)[-2]
    f = max(0.0, (hi.peak - lo.peak) / max(1, hi.num_tokens - lo.num_tokens))
    e = max(p.peak - f * p.num_tokens for p in dec)
    return ActivationModel((a_d[0], a_d[1], a_d[2], a_d[3]), (e, f), tile, max_num_seqs, tuple(points))


def profile_points(
    model: ConfiguredModel, layout: KVCacheLayout, device: torch.device, vocab_size: int, token_counts: list[int],
    max_context: int, decode_rows: list[int], tile: int = CONTEXT_TILE, attention_backend: str | None = None,
) -> list[ProfilePoint]:
    """Prefill chunks of each T in token_counts at context T (a fresh prompt) and at max_context (the worst
    case); decode steps of each row count at context min(max_context, tile), where their workspace tops out,
    and a few rows at max_context to confirm it stays flat."""
    # Dummy tokens route wherever they happen to; the plan must hold for the worst routing (every token of a
    # step through the same experts), so MoE layers are told to route that way while profiling.
    routers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    for m in routers:
        m.force_worst_routing = True
    try:
        points = _measure(model, layout, device, vocab_size, token_counts, max_context, decode_rows, tile,
                          attention_backend)
    finally:
        for m in routers:
            m.force_worst_routing = False
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the scratch pool is gone; give its memory back before the real one
    return points


def profile_shapes(token_counts: list[int], max_context: int, decode_rows: list[int],
                   tile: int = CONTEXT_TILE) -> list[tuple[str, int, int]]:
    """The (kind, num_tokens, context) of every point profile_points measures, in its order. One function for
    the measurement and for checking a cached entry, so the two cannot drift apart. The list may repeat a
    shape (few rows and max_context <= tile): the decode fit needs two points, so it is kept, not merged."""
    shapes = [("prefill", t, ctx) for t in token_counts for ctx in sorted({t, max_context})]
    short = min(max_context, tile)
    shapes += [("decode", d, short) for d in decode_rows]
    shapes.append(("decode", min(4, *decode_rows), max_context))
    return shapes


def _measure(
    model: ConfiguredModel, layout: KVCacheLayout, device: torch.device, vocab_size: int, token_counts: list[int],
    max_context: int, decode_rows: list[int], tile: int, attention_backend: str | None,
) -> list[ProfilePoint]:
    block_size = layout.block_size
    num_blocks = -(-max_context // block_size)
    # A scratch pool for one max_context sequence; decodes and every group share its block table (values do
    # not matter).
    num_layers = layout.num_layers
    # A state slot per decode row (prefills use slot 0), as the engine's one slot per running request.
    caches = allocate_kv_caches(layout, num_layers, num_blocks, device, max(decode_rows))
    runner = ModelRunner(model, caches, block_size, device,
                         groups=attention_groups(layout, device, attention_backend), state_groups=layout.state_groups)
    blocks = tuple(list(range(num_blocks)) for _ in layout.groups)

    def measure(kind: str, n: int, ctx: int) -> ProfilePoint:
        if kind == "prefill":
            step, meta = StepBatch().add([0] * n, ctx - n, blocks, True, 0), _meta(1, ctx, vocab_size, device)
        else:
            step = StepBatch()
            for i in range(n):
                step.add([0], ctx - 1, blocks, True, i)
            meta = _meta(n, ctx, vocab_size, device)
        return ProfilePoint(kind, n, ctx, measure_peak(lambda: runner.run(step, meta()), device))

    return [measure(kind, n, ctx) for kind, n, ctx in profile_shapes(token_counts, max_context, decode_rows, tile)]


def _meta(rows: int, history: int, vocab_size: int, device: torch.device) -> Callable[[], SamplingMetadata]:
    """The worst sampling batch, built beforehand; the step's own part of it is made inside the measurement."""
    prompt = [i % vocab_size for i in range(min(history, 4096))]
    batch, positions, counts = sampling_batch([_WORST_PARAMS] * rows, vocab_size, device, prompts=[prompt] * rows,
                                              outputs=[prompt[:64]] * rows)
    return lambda: batch.step(positions, counts)
