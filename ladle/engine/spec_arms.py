"""Whether a decode step drafts at all: the output rate measured with drafts against without, per batch size.

The per-row gate (ladle.engine.spec_gate) prices drafts with a linear model of step time; a step whose every
draft is accepted can still be slower than plain decoding where the step is compute-bound (16 rows x 6 tokens
on two CPU cores took 6x a 16-token step) or where a chunk's attention path costs more than the decode
kernel's. So each decode-only step's output rate (tokens it produced per ms) is kept for steps with drafts and
steps without, per batch size (rows, in powers of two), and a step drafts while that is the faster arm. The
other arm is tried once every EXPLORE_EVERY steps, so a change of workload is seen.
"""
from __future__ import annotations

from dataclasses import dataclass

EXPLORE_EVERY = 32
MIN_SEEN = 3.0  # decayed observations of an arm before its rate is compared
DECAY = 0.9


@dataclass
class _Arm:
    rate: float = 0.0  # tokens per ms, a decayed mean
    seen: float = 0.0

    def add(self, value: float) -> None:
        weight = self.seen * DECAY
        self.rate = (self.rate * weight + value) / (weight + 1)
        self.seen = weight + 1


class StepArms:
    def __init__(self) -> None:
        self._arms: dict[int, tuple[_Arm, _Arm]] = {}  # batch-size bucket -> (without drafts, with drafts)
        self._steps: dict[int, int] = {}

    def drafts_now(self, rows: int) -> bool:
        """Whether a decode step of `rows` decode rows should carry drafts."""
        b = rows.bit_length()
        plain, drafted = self._arms.setdefault(b, (_Arm(), _Arm()))
        n = self._steps[b] = self._steps.get(b, 0) + 1
        if drafted.seen < MIN_SEEN:
            return True  # drafts first: a step with none to offer costs only the lookups
        if plain.seen < MIN_SEEN:
            return False
        better = drafted.rate >= plain.rate
        return better != (n % EXPLORE_EVERY == 0)

    def record(self, rows: int, drafted: bool, tokens: int, ms: float) -> None:
        """A decode-only step of `rows` rows produced `tokens` tokens in ms, with drafts or without."""
        if ms > 0:
            self._arms.setdefault(rows.bit_length(), (_Arm(), _Arm()))[drafted].add(tokens / ms)

    def rates(self, rows: int) -> tuple[float, float] | None:
        """(without drafts, with drafts) tokens per ms at this batch size, once both were seen."""
        arms = self._arms.get(rows.bit_length())
        return None if arms is None or min(a.seen for a in arms) < MIN_SEEN else (arms[0].rate, arms[1].rate)
