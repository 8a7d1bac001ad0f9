"""``lpm``: longest prefix match first (SGLang's LPM policy, Zheng et al., "SGLang: Efficient
Execution of Structured Language Model Programs", 2024), with an aging bound.

Waiting requests are ordered by how many of their prompt tokens are already in the prefix cache,
longest first (stable: ties keep arrival order). As in SGLang:

- with more than ``lpm_fcfs_threshold`` requests waiting, matching costs more than it saves:
  plain arrival order;
- of several waiting requests whose next uncached block is the same (they share a prefix nobody
  has computed yet), only the first is admitted this step; the others wait one step and then
  hit the blocks it computed.

Beyond SGLang, whose LPM starves requests that never match: a request that has waited
``lpm_max_wait`` seconds or more goes first, in arrival order.

Match lengths are cached per request and re-checked only when the prefix cache changed: only
from the old length when no block was evicted since (cached prefixes then only grow).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pagebatch.config import ConfigOption, parse_int
from pagebatch.hookspecs import hookimpl
from pagebatch.kv_cache import KVCacheManager
from pagebatch.request import Request
from pagebatch.scheduler import PolicyContext, SchedulingPolicy

DEFAULT_FCFS_THRESHOLD = 128
DEFAULT_MAX_WAIT_S = 30.0


class LPMPolicy(SchedulingPolicy):
    def __init__(self, config: object | None = None) -> None:
        super().__init__(config)
        opts = getattr(config, "plugin_options", None) or {}
        self.fcfs_threshold = int(opts.get("lpm_fcfs_threshold", DEFAULT_FCFS_THRESHOLD))
        self.max_wait = float(opts.get("lpm_max_wait", DEFAULT_MAX_WAIT_S))
        # request id -> (matched blocks, pool evictions, pool inserts) when last matched
        self._match: dict[str, tuple[int, int, int]] = {}

    def match_blocks(self, req: Request, kv: KVCacheManager) -> int:
        """Leading blocks of the request found in the prefix cache (cached between changes)."""
        pool = kv.pool
        stamp = (pool.num_evictions, pool.num_cached_inserts)
        old = self._match.get(req.request_id)
        if old is not None and old[1:] == stamp:
            return old[0]
        start = old[0] if old is not None and old[1] == pool.num_evictions else 0
        n = kv.num_cached_prefix_blocks(req.block_hashes, start)
        self._match[req.request_id] = (n, *stamp)
        return n

    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> Iterable[Request]:
        if len(waiting) > self.fcfs_threshold:
            self._match.clear()
            return waiting
        live = {r.request_id for r in waiting}
        for rid in [k for k in self._match if k not in live]:
            del self._match[rid]
        aged = [r for r in waiting if ctx.now - r.arrival_time >= self.max_wait]
        aged_ids = {id(r) for r in aged}
        rest = [r for r in waiting if id(r) not in aged_ids]
        matched = {id(r): self.match_blocks(r, ctx.kv_cache) for r in rest}
        rest.sort(key=lambda r: -matched[id(r)])
        first_of_prefix: set[bytes] = set()
        ordered = list(aged)
        for r in rest:
            m = matched[id(r)]
            nxt = r.block_hashes[m] if m < len(r.block_hashes) else None
            if nxt is not None:
                if nxt in first_of_prefix:
                    continue  # another request computes this prefix first; hit it next step
                first_of_prefix.add(nxt)
            ordered.append(r)
        return ordered

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        return candidates[-1]


def _non_negative_float(v) -> float:
    x = float(v)
    if not x >= 0.0:
        raise ValueError("must be a number >= 0")
    return x


@hookimpl
def register_scheduling_policies(register):
    register("lpm", LPMPolicy)


@hookimpl
def register_config_options(register):
    register(ConfigOption(
        "lpm_fcfs_threshold", DEFAULT_FCFS_THRESHOLD,
        "lpm: with more requests than this waiting, admit in arrival order.", parse_int(1)))
    register(ConfigOption(
        "lpm_max_wait", DEFAULT_MAX_WAIT_S,
        "lpm: seconds after which a waiting request is served in arrival order (aging).",
        _non_negative_float))
