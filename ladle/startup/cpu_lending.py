"""The CPUs `ladle serve` reserves for its API process, lent to the engine's steps while nothing else uses them.

The API process needs its CPU for a few percent of the time (measured beside vLLM: about 3%), so a reserved CPU
mostly idles, while a step runs 1.3-1.8x faster with a second thread (bf16, 2 cores: 300-token prefill 576 vs
313 ms, decode of 4 rows 17.8 vs 12.2 ms). Lending it back is safe only while it stays idle: a team thread
that another process preempts holds the whole team at its next barrier (BENCHMARKS.md, "CPU threads under
load"). So before a step the lender looks at how much CPU time processes other than the engine took on the
engine's CPUs and the lent ones over the last window (/proc/stat less the engine's own time), and runs the
step with the lent CPUs only while that stays under OTHER_LOAD_LIMIT. The team's threads are bound once, at
startup (threads.apply_threads), to one CPU each; lending is torch.set_num_threads. Dense models give the same
bits at any thread count (tests/test_cpu_lending.py), so lending never changes their outputs; mixture-of-experts
models do not, and are not lent to (threads.keep_lending).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# In CPUs' worth of time: the API process serving requests and a benchmark client stay far below it; a
# neighbour busy on one CPU is far above it.
OTHER_LOAD_LIMIT = 0.25
WINDOW_S = 0.2  # at 100 ticks a second, 40 ticks over two CPUs: coarse enough to read, short enough to react


@dataclass(frozen=True)
class CpuLending:
    """What setup decided: the engine runs base_threads threads, plus one on each lent CPU while it is free."""
    base_threads: int
    cpus: tuple[int, ...]  # every CPU the team is bound to: the engine's own, then the lent ones

    @property
    def lent(self) -> int:
        return len(self.cpus) - self.base_threads


@dataclass(frozen=True)
class CpuTicks:
    busy: int  # over the watched CPUs, in clock ticks
    total: int
    own: int  # this process's user + system time


def read_ticks(cpus: tuple[int, ...], proc: Path = Path("/proc")) -> CpuTicks:
    busy = total = 0
    names = {f"cpu{c}" for c in cpus}
    for line in (proc / "stat").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] in names:
            # user nice system idle iowait irq softirq steal (guest time is already inside user)
            ticks = [int(f) for f in fields[1:9]]
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    stat = (proc / "self" / "stat").read_text()
    utime, stime = stat[stat.rindex(")") + 2:].split()[11:13]  # fields 14 and 15 of proc(5)
    return CpuTicks(busy, total, int(utime) + int(stime))


def other_load(before: CpuTicks, after: CpuTicks, num_cpus: int) -> float:
    """CPUs' worth of time that other processes took on the watched CPUs between two readings."""
    total = after.total - before.total
    if total <= 0:
        return 0.0
    other = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, other / total * num_cpus)


class CpuLender:
    def __init__(self, lending: CpuLending, set_threads: Callable[[int], None],
                 read: Callable[[], CpuTicks] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.lending = lending
        self.set_threads = set_threads
        self.read = read or (lambda: read_ticks(lending.cpus))
        self.clock = clock
        self.threads = lending.base_threads
        self.last_load = 0.0
        self._last, self._at = self.read(), clock()

    def before_step(self) -> int:
        """The threads the next step runs with."""
        self.observe()
        return self.threads

    def observe(self) -> None:
        """Read the load of the last window, at most once a window. An idle engine calls this too, every
        window, so the first step after a pause is judged by the last window, not by the whole pause."""
        now = self.clock()
        if now - self._at < WINDOW_S:
            return
        ticks = self.read()
        self.last_load = other_load(self._last, ticks, len(self.lending.cpus))
        self._last, self._at = ticks, now
        threads = self.lending.base_threads + (self.lending.lent if self.last_load < OTHER_LOAD_LIMIT else 0)
        if threads != self.threads:
            self.set_threads(threads)
            self.threads = threads


def lending_reason(lent: list[int]) -> str:
    return (f"CPU {' '.join(map(str, lent))} reserved for the API process, lent to a step while processes other "
            f"than the engine used under {OTHER_LOAD_LIMIT} CPU over the last {WINDOW_S} s")
