"""``priority``: a per-request integer priority, lower runs first, ties by arrival.

The victim of a preemption is the running request with the worst (priority, arrival). A
preempted request keeps its arrival, so it keeps its place among requests of its priority.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pagebatch.hookspecs import hookimpl
from pagebatch.request import Request
from pagebatch.scheduler import PolicyContext, SchedulingPolicy


def _rank(r: Request) -> tuple[int, int]:
    return (r.priority, r.arrival_seq)


class PriorityPolicy(SchedulingPolicy):
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> Iterable[Request]:
        return sorted(waiting, key=_rank)

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=_rank)


@hookimpl
def register_scheduling_policies(register):
    register("priority", PriorityPolicy)
