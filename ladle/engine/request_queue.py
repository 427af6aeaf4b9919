"""The waiting queue, in the order the scheduling policy serves it (vLLM's --scheduling-policy).

fcfs: arrival order; a preempted request goes back to the front, ahead of everything that waited behind it.
priority: lower `priority` first, then earlier arrival; a preempted request goes back to its place in that
order (its arrival time is kept, so it is still ahead of later arrivals of its priority).
"""
from __future__ import annotations

import bisect
from typing import Iterator

from ladle.config.engine_args import SCHEDULING_POLICIES
from ladle.request import Request


class RequestQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={policy!r}: choose one of {', '.join(SCHEDULING_POLICIES)}")
        self.policy = policy
        self._items: list[Request] = []

    @staticmethod
    def key(req: Request) -> tuple[int, float]:
        """The priority policy's order: lower priority value first, then earlier arrival."""
        return req.priority, req.arrival_time

    def add(self, req: Request) -> None:
        """A new arrival."""
        if self.policy == "fcfs":
            self._items.append(req)
        else:
            bisect.insort(self._items, req, key=self.key)

    def prepend(self, req: Request) -> None:
        """A preempted or restarted request, to be served before the queue's newer arrivals."""
        if self.policy == "fcfs":
            self._items.insert(0, req)
        else:
            bisect.insort_left(self._items, req, key=self.key)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._items))  # a copy: the scheduler removes what it admits while it walks

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, req: object) -> bool:
        return req in self._items

    def __getitem__(self, i: int) -> Request:
        return self._items[i]
