"""``fcfs``: first come, first served.

Admission in arrival order (a preempted request keeps its original arrival, so it goes back
ahead of later arrivals); the victim of a preemption is the request admitted last.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pagebatch.hookspecs import hookimpl
from pagebatch.request import Request
from pagebatch.scheduler import PolicyContext, SchedulingPolicy


class FCFSPolicy(SchedulingPolicy):
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> Iterable[Request]:
        return waiting

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        return candidates[-1]


@hookimpl
def register_scheduling_policies(register):
    register("fcfs", FCFSPolicy)
