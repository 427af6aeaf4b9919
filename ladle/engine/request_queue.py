"""Scheduling policies (vLLM's --scheduling-policy) and the waiting queue served in a policy's order.

A policy says three things: the order requests are served in (waiting and running alike), which running request
a preemption takes, and where a preempted request goes back into the queue.
fcfs: arrival order; a preempted request goes back to the front, ahead of everything that waited behind it; the
newest request is preempted first.
priority: lower `priority` first, then earlier arrival; a preempted request goes back to its place in that
order (its arrival time is kept, so it is still ahead of later arrivals of its priority); the lowest priority
(newest among equals) is preempted first.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import ClassVar

from ladle.config.engine_args import SCHEDULING_POLICIES
from ladle.request import Request, RequestRejected


class SchedulingPolicy:
    name: ClassVar[str]

    def check(self, request: Request) -> None:
        """Reject at once a request this policy cannot serve as asked."""

    def order(self, running: list[Request]) -> list[Request]:
        """The running requests in the order a step serves them."""
        raise NotImplementedError

    def victim(self, unscheduled: list[Request]) -> Request:
        """Which of the running requests not yet scheduled this step a preemption takes."""
        raise NotImplementedError

    def add(self, items: list[Request], req: Request) -> None:
        """A new arrival joins the queue."""
        raise NotImplementedError

    def requeue(self, items: list[Request], req: Request) -> None:
        """A preempted or restarted request goes back, to be served before the queue's newer arrivals."""
        raise NotImplementedError


class FcfsPolicy(SchedulingPolicy):
    name = "fcfs"

    def check(self, request: Request) -> None:
        if request.priority != 0:
            raise RequestRejected(f"priority={request.priority} needs priority scheduling; this engine runs "
                                  f"scheduling_policy={self.name!r}: drop priority or start the engine "
                                  "with scheduling_policy='priority'")

    def order(self, running: list[Request]) -> list[Request]:
        return running  # admission order already

    def victim(self, unscheduled: list[Request]) -> Request:
        return unscheduled[-1]

    def add(self, items: list[Request], req: Request) -> None:
        items.append(req)

    def requeue(self, items: list[Request], req: Request) -> None:
        items.insert(0, req)


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    @staticmethod
    def key(req: Request) -> tuple[int, float]:
        """Lower priority value first, then earlier arrival."""
        return req.priority, req.arrival_time

    def order(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=self.key)

    def victim(self, unscheduled: list[Request]) -> Request:
        return max(unscheduled, key=self.key)

    def add(self, items: list[Request], req: Request) -> None:
        bisect.insort(items, req, key=self.key)

    def requeue(self, items: list[Request], req: Request) -> None:
        bisect.insort_left(items, req, key=self.key)


def scheduling_policy(name: str) -> SchedulingPolicy:
    """The policy named by --scheduling-policy."""
    for cls in (FcfsPolicy, PriorityPolicy):
        if cls.name == name:
            return cls()
    raise ValueError(f"scheduling_policy={name!r}: choose one of {', '.join(SCHEDULING_POLICIES)}")


class RequestQueue:
    """The waiting requests, in the order their policy serves them."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._items: list[Request] = []

    def add(self, req: Request) -> None:
        self.policy.add(self._items, req)

    def prepend(self, req: Request) -> None:
        self.policy.requeue(self._items, req)

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
