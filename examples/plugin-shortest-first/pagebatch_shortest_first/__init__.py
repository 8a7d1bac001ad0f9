"""``shortest_first``: admit the waiting request with the fewest uncomputed tokens first.

An example of a third-party pagebatch plugin: a scheduling policy with one option of its own.
Shortest-job-first lowers mean latency when prompt lengths vary a lot, at the price of fairness:
``shortest_first_max_wait`` seconds bounds how long a long request can be passed over.
"""

from __future__ import annotations

from pagebatch import ConfigOption, hookimpl
from pagebatch.scheduler import SchedulingPolicy

__version__ = "0.1.0"


class ShortestFirstPolicy(SchedulingPolicy):
    def __init__(self, config=None):
        super().__init__(config)
        opts = getattr(config, "plugin_options", None) or {}
        self.max_wait = float(opts.get("shortest_first_max_wait", 60.0))

    def order_waiting(self, waiting, ctx):
        old = [r for r in waiting if ctx.now - r.arrival_time >= self.max_wait]
        rest = [r for r in waiting if ctx.now - r.arrival_time < self.max_wait]
        rest.sort(key=lambda r: r.num_tokens - r.num_computed_tokens)
        return old + rest

    def select_victim(self, candidates):
        # preempt the request with the most work left: it loses the least by waiting
        return max(candidates, key=lambda r: (r.num_tokens, r.arrival_seq))


@hookimpl
def register_scheduling_policies(register):
    register("shortest_first", ShortestFirstPolicy)


@hookimpl
def register_config_options(register):
    register(ConfigOption("shortest_first_max_wait", 60.0,
                          "shortest_first: seconds after which a request goes first anyway.",
                          float))
