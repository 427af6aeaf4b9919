"""The sampling side of a batch, kept on the device: built when the batch's requests change, reused every step.

A step then costs the sampler no host lists and no blocking copies: the parameters, row indices and penalty
rows are device tensors made once per batch composition, and what changes from step to step is small and
computed on the host without reading the device (each random row's uniform draw, the stop tokens min_tokens
still blocks).

Random rows draw by inverse CDF from one uniform each. A seeded request's uniform is a counter-based hash of
(seed, position of the token drawn): a pure function, so a seeded stream does not depend on the batch, on a
preemption (the recomputed request draws at the same positions) or on a retried step, and a whole batch of
seeded rows samples in one pass instead of one draw per row from its own generator. Unseeded rows take their
uniforms from the runner's host generator, seeded by the engine's seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ladle.runner.penalty_counts import PenaltyCounts
from ladle.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Draws are scaled below 1 - 2**-20, so u x total stays below the total in float32 (ladle.runner.sampler).
_BELOW_ONE = 1.0 - 2.0**-20


_U = np.uint64
_SHIFTS, _MULTS = (_U(30), _U(27), _U(31)), (_U(0xBF58476D1CE4E5B9), _U(0x94D049BB133111EB))
_GOLDEN, _POSITION, _TOP53 = _U(0x9E3779B97F4A7C15), _U(0xD1B54A32D192ED03), _U(11)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place on a uint64 array (array arithmetic wraps silently, as it needs)."""
    z ^= z >> _SHIFTS[0]
    z *= _MULTS[0]
    z ^= z >> _SHIFTS[1]
    z *= _MULTS[1]
    z ^= z >> _SHIFTS[2]
    return z


def seed_keys(seeds: np.ndarray) -> np.ndarray:
    """Each uint64 seed's hash key (counter_uniforms' first half: once per batch, not per step)."""
    return _mix(seeds + _GOLDEN)


def counter_uniforms(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1), one per (seed key, position) pair, as float64 with 53 random bits."""
    z = positions.astype(np.uint64)
    z *= _POSITION
    z ^= keys
    return (_mix(z) >> _TOP53) * 2.0**-53


def penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device)[:, None]


# Candidates a CPU top-k / top-p row sorts first (more when its top_k is larger); where they are half the
# vocabulary or more, the full sort costs no more.
CPU_CANDIDATES = 256


@dataclass(frozen=True)
class Filters:
    """Some random rows' top-k / top-p / min-p, as [rows, 1] columns (None where no row uses the filter)."""

    top_k: torch.Tensor | None  # long, vocab where a row has none
    has_top_k: torch.Tensor | None  # bool
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> Filters:
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_k = torch.tensor(ks, dtype=torch.long).to(device)[:, None] if any(k < vocab for k in ks) else None
        return cls(top_k, None if top_k is None else top_k < vocab,
                   # 2 for a row without top_p: no mass before a token reaches it, whatever the rounding
                   _column([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device)
                   if any(p.top_p < 1.0 for p in params) else None,
                   _column([p.min_p for p in params], device) if any(p.min_p > 0.0 for p in params) else None)

    def rows(self, index: torch.Tensor) -> Filters:
        return Filters(*(None if t is None else t.index_select(0, index)
                         for t in (self.top_k, self.has_top_k, self.top_p, self.min_p)))


@dataclass(frozen=True)
class FilterSplit:
    """Which random rows keep only some tokens (top-k / top-p) and how they sort. A row without those filters
    always draws from the softmax in vocabulary order, a filtered one from its logits sorted descending (ties
    by token id), whatever else is in the batch, so a seeded row's draw depends on its own row alone."""

    plain: torch.Tensor | None  # indices among the random rows without a filter (None: there are none)
    filtered: torch.Tensor | None  # indices among the random rows with one (None: all of them)
    filters: Filters  # the filtered rows'
    # CPU: sort only the largest `candidates` where they hold all a row keeps (None: the full sort)
    candidates: int | None
    all_top_k: bool  # every filtered row has a top-k, so its candidates hold its whole renormalized mass

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> FilterSplit | None:
        keeps_some = [0 < p.top_k < vocab or p.top_p < 1.0 for p in params]
        filtered = [i for i, f in enumerate(keeps_some) if f]
        if not filtered:
            return None
        plain = [i for i, f in enumerate(keeps_some) if not f]
        ks = [params[i].top_k for i in filtered if 0 < params[i].top_k < vocab]
        most = max([CPU_CANDIDATES, *ks])
        candidates = most if device.type == "cpu" and 2 * most < vocab else None
        return cls(_index(plain, device) if plain else None, _index(filtered, device) if plain else None,
                   Filters.of([params[i] for i in filtered], vocab, device), candidates, len(ks) == len(filtered))


@dataclass
class SamplingMetadata:
    """What the sampler needs for one step: the batch's tensors and this step's draws and masks."""

    batch: SamplingBatch
    uniforms: torch.Tensor | None  # [random rows] on the device: each random row's draw
    blocked: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) of stop tokens min_tokens blocks
    output_counts: torch.Tensor | None  # [penalized rows, vocab] float32: tokens generated so far
    prompt_seen: torch.Tensor | None  # [penalized rows, vocab] bool: tokens in the prompt
    # (rows, [rows, words] int32 bitmasks) of the constrained rows: the only tokens each may sample
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None


class SamplingBatch:
    """One batch composition's sampling parameters: rows in logits order."""

    def __init__(self, params: list[SamplingParams], prompt_lens: list[int], stop_token_ids: list[frozenset[int]],
                 vocab: int, device: torch.device, penalty_rows: list[int] | None = None,
                 generator: torch.Generator | None = None) -> None:
        """penalty_rows: each penalized row's row in the PenaltyCounts (in the order of the penalized rows);
        generator: the host generator unseeded rows draw from (None: torch's global one)."""
        self.params, self.vocab, self.device, self.generator = params, vocab, device, generator
        n = len(params)
        self.all_greedy = all(p.greedy for p in params)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rand = [i for i, p in enumerate(params) if not p.greedy]
        self.greedy_rows = _index(greedy, device) if greedy and rand else None
        self.random_rows = _index(rand, device) if greedy and rand else None
        self.num_random = len(rand)
        self._random_host = np.array(rand, dtype=np.int64)
        rp = [params[i] for i in rand]
        self.temperature = _column([p.temperature for p in rp], device) if rp else None
        self.min_p = _column([p.min_p for p in rp], device) if any(p.min_p > 0.0 for p in rp) else None
        self.split = FilterSplit.of(rp, vocab, device)
        # The seeded random rows' seeds (as uint64) and where they sit among the random rows.
        self.seeded = np.array([p.seed is not None for p in rp], dtype=bool)
        self.seed_keys = seed_keys(np.array([(p.seed or 0) & _MASK64 for p in rp], dtype=np.uint64))
        self.all_seeded = bool(self.seeded.all()) if rp else False
        self.any_seeded = bool(self.seeded.any())

        pen = [i for i, p in enumerate(params) if penalized(p)]
        pp = [params[i] for i in pen]
        self.penalized = _index(pen, device) if pen else None
        self.penalized_host = pen
        self.counts_rows = _index(penalty_rows or [], device) if pen else None
        self.repetition = (_column([p.repetition_penalty for p in pp], device)
                           if any(p.repetition_penalty != 1.0 for p in pp) else None)
        self.frequency = (_column([p.frequency_penalty for p in pp], device)
                          if any(p.frequency_penalty != 0.0 for p in pp) else None)
        self.presence = (_column([p.presence_penalty for p in pp], device)
                         if any(p.presence_penalty != 0.0 for p in pp) else None)
        if pen and len(penalty_rows or []) != len(pen):
            raise ValueError(f"{len(pen)} penalized rows need as many PenaltyCounts rows, got {penalty_rows}")

        lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.logprob_rows = _index(lp, device) if lp else None
        self.logprob_counts = [min(params[i].logprobs or 0, vocab) for i in lp]
        self.logprob_host = lp
        # min_tokens: (row, tokens its request must generate first, prompt length, its stop tokens in range).
        self.min_tokens = [(i, p.min_tokens, prompt_lens[i], [t for t in stop_token_ids[i] if 0 <= t < vocab])
                           for i, p in enumerate(params) if p.min_tokens > 0]
        self.deferrable = not pen and not lp
        self.num_rows = n

    @property
    def needs_positions(self) -> bool:
        """Whether step() reads the positions (seeded draws, min_tokens): else it may get None."""
        return bool(self.any_seeded or self.min_tokens)

    def step(self, positions: np.ndarray | None, counts: PenaltyCounts | None = None,
             bitmasks: list[tuple[int, np.ndarray]] | None = None) -> SamplingMetadata:
        """This step's metadata; positions: [rows] int64, the position of the token each row draws (tokens
        the request holds before it, prompt included); bitmasks: (row, int32 words) of each constrained row,
        bit t % 32 of word t // 32 set where token t is allowed."""
        uniforms = None
        if self.num_random:
            if self.any_seeded:
                assert positions is not None
                rand_pos = positions if self.random_rows is None else positions[self._random_host]
                if self.all_seeded:
                    u = counter_uniforms(self.seed_keys, rand_pos)
                else:
                    u = torch.rand(self.num_random, dtype=torch.float64, generator=self.generator).numpy()
                    u[self.seeded] = counter_uniforms(self.seed_keys[self.seeded], rand_pos[self.seeded])
                host = torch.from_numpy(u * _BELOW_ONE)
            else:
                host = torch.rand(self.num_random, dtype=torch.float64, generator=self.generator).mul_(_BELOW_ONE)
            uniforms = (host.pin_memory() if self.device.type == "cuda" else host).to(self.device, non_blocking=True)
        blocked = None
        if self.min_tokens:
            assert positions is not None
            pairs = [(i, t) for i, need, plen, stops in self.min_tokens if positions[i] - plen < need for t in stops]
            if pairs:
                blocked = (_index([i for i, _ in pairs], self.device), _index([t for _, t in pairs], self.device))
        output_counts = prompt_seen = None
        if self.penalized is not None:
            if counts is None:
                raise ValueError("a batch with penalties needs its PenaltyCounts")
            assert self.counts_rows is not None  # set whenever penalized is
            output_counts, prompt_seen = counts.gather(self.counts_rows)
        allowed = None
        if bitmasks:
            words = torch.from_numpy(np.stack([m for _, m in bitmasks]))
            allowed = (_index([i for i, _ in bitmasks], self.device), words.to(self.device))
        return SamplingMetadata(self, uniforms, blocked, output_counts, prompt_seen, allowed)


def sampling_metadata(params: list[SamplingParams], vocab: int, device: torch.device | str = "cpu", *,
                      prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
                      stops: list[frozenset[int]] | None = None,
                      positions: list[int] | None = None) -> SamplingMetadata:
    """One step's metadata from plain lists (tests, profiling): the path the runner takes, with a fresh
    PenaltyCounts. positions default to each row's prompt + output length."""
    batch, pos, counts = sampling_batch(params, vocab, device, prompts=prompts, outputs=outputs, stops=stops,
                                        positions=positions)
    return batch.step(pos, counts)


def sampling_batch(params: list[SamplingParams], vocab: int, device: torch.device | str = "cpu", *,
                   prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
                   stops: list[frozenset[int]] | None = None,
                   positions: list[int] | None = None) -> tuple[SamplingBatch, np.ndarray, PenaltyCounts]:
    """sampling_metadata's parts, for a caller that takes the step itself (profiling measures it)."""
    device = torch.device(device)
    n = len(params)
    prompts = prompts or [[] for _ in range(n)]
    outputs = outputs or [[] for _ in range(n)]
    counts = PenaltyCounts(n, vocab, device)
    rows = []
    for i, p in enumerate(params):
        if penalized(p):
            row = counts.take()
            assert row is not None
            counts.fill(row, prompts[i], outputs[i])
            rows.append(row)
    batch = SamplingBatch(params, [len(p) for p in prompts], stops or [frozenset()] * n, vocab, device, rows)
    pos = positions if positions is not None else [len(p) + len(o) for p, o in zip(prompts, outputs)]
    return batch, np.array(pos, dtype=np.int64), counts
