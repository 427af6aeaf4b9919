"""Whether a decode step drafts at all: the output rate measured with drafts against without, per batch size.
The per-row gate (ladle.engine.speculation.gate) prices drafts with a linear model of step time; a step whose every
draft is accepted can still be slower than plain decoding where the step is compute-bound (16 rows x 6 tokens
on two CPU cores took 6x a 16-token step) or where a chunk's attention path costs more than the decode
kernel's. So each decode-only step's output rate (tokens it produced per ms) is kept for steps with drafts and
steps without, per batch size (rows, in powers of two), and a step drafts while that is the faster arm. The
other arm is tried every EXPLORE_EVERY steps at first, and half as often each time it loses again (down to one
step in MAX_EXPLORE_EVERY), so a change of workload is seen while a settled choice costs almost nothing: an
explored step with k drafts at batch 16 cost 3-4 plain steps. The interval starts over whenever the faster arm
changes. A batch size settled on plain steps (settled_plain) lets the model's MTP layer rest too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 32
MAX_EXPLORE_EVERY = 512
SETTLED = 256  # an exploration interval this long: the faster arm has won every exploration for a while
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


@dataclass
class _Bucket:
    plain: _Arm = field(default_factory=_Arm)
    drafted: _Arm = field(default_factory=_Arm)
    drafts_win: bool | None = None  # the faster arm at the last decision (None: not compared yet)
    interval: int = EXPLORE_EVERY  # steps between explorations of the slower arm
    countdown: int = EXPLORE_EVERY  # steps to the next one


class StepArms:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}  # batch-size bucket -> its two arms

    def _bucket(self, rows: int) -> _Bucket:
        b = self._buckets.get(rows.bit_length())
        if b is None:
            b = self._buckets[rows.bit_length()] = _Bucket()
        return b

    def drafts_now(self, rows: int) -> bool:
        """Whether a decode step of `rows` decode rows should carry drafts."""
        b = self._bucket(rows)
        if b.drafted.seen < MIN_SEEN:
            return True  # drafts first: a step with none to offer costs only the lookups
        if b.plain.seen < MIN_SEEN:
            return False
        better = b.drafted.rate >= b.plain.rate
        if better != b.drafts_win:
            b.drafts_win, b.interval, b.countdown = better, EXPLORE_EVERY, EXPLORE_EVERY
        b.countdown -= 1
        if b.countdown > 0:
            return better
        b.interval = min(2 * b.interval, MAX_EXPLORE_EVERY)
        b.countdown = b.interval
        return not better

    def settled_plain(self, rows: int) -> bool:
        """Whether steps of this many rows have settled on no drafts (plain has won every exploration lately)."""
        b = self._buckets.get(rows.bit_length())
        return b is not None and b.drafts_win is False and b.interval >= SETTLED

    def record(self, rows: int, drafted: bool, tokens: int, ms: float) -> None:
        """A decode-only step of `rows` rows produced `tokens` tokens in ms, with drafts or without."""
        if ms > 0:
            b = self._bucket(rows)
            (b.drafted if drafted else b.plain).add(tokens / ms)

    def rates(self, rows: int) -> tuple[float, float] | None:
        """(without drafts, with drafts) tokens per ms at this batch size, once both were seen."""
        b = self._buckets.get(rows.bit_length())
        return None if b is None or min(b.plain.seen, b.drafted.seen) < MIN_SEEN else (b.plain.rate, b.drafted.rate)
