"""KV cache groups of a hybrid model (full-attention and sliding-window layers mixed) and the
block manager that keeps one block table per group (pure Python, no torch).

The design is vLLM v1's hybrid KV cache manager (``HybridKVCacheCoordinator`` with
``get_kv_cache_groups``): the layers are split into *groups* of one attention type (the same
window, or full attention) and of equal size ``g``, the greatest common divisor of the types'
layer counts, so that every group has exactly ``g`` layers (vLLM takes the smallest count and
pads the last group of a type; a padded group's block ids cost ``g`` layers' bytes for fewer
layers, which can make a short request cost more than with one whole table: 16 full + 12
windowed layers in groups of 12 hold 36 layer slots a block position against 28). The runner
allocates ``g`` cache tensors of ``num_blocks`` blocks, and the ``s``-th layer of every group
uses tensor ``s``: a block id belongs to one group at a time, so layers of different groups
never write the same block, and a block id costs ``g`` layers' bytes instead of all layers'.
Each request has one block table per group, all of the same logical length; a windowed group's
table returns the blocks behind its window (core/kv_cache.py), a full one keeps all of them, so
a long request holds its whole length only in the full groups.

`HybridKVCacheManager` has `KVCacheManager`'s interface (the scheduler cannot tell them
apart). A request's block ids, as handed to the runner (``allocate_slots``, ``block_ids``), are
the groups' tables *interleaved*: logical block ``j`` is entries ``j * G .. j * G + G - 1``, one
per group in group order (`deinterleave` undoes it); every group gains the same number of
logical blocks per step. A prefix-cache hit is the longest prefix that every group can use: a
full group needs all of its blocks cached, a windowed one only those inside the window of the
first token to compute (found by narrowing the length until every group agrees).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .block_hash import BlockHash
from .kv_cache import (BlockPool, BlockTable, KVCacheBlock, KVCacheManager, PoolAccounting,
                       PrefixCacheStats)

__all__ = ["KVCacheGroups", "kv_cache_groups", "MAX_KV_GROUPS", "HybridKVCacheManager",
           "interleave", "deinterleave"]


@dataclass(frozen=True)
class KVCacheGroups:
    """How the layers share the KV cache.

    ``windows[k]``: group k's sliding window in tokens, None for full attention;
    ``layer_group[i]`` / ``layer_slot[i]``: checkpoint layer i's group and its cache tensor
    (0 .. ``num_slots - 1``). One group: every layer has its own tensor (``layer_slot[i] == i``).
    """

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)


MAX_KV_GROUPS = 8  # more groups than this: one whole table instead (`kv_cache_groups`)


def kv_cache_groups(layer_windows: Sequence[int | None]) -> KVCacheGroups | None:
    """Group the layers by attention type (``layer_windows[i]``: layer i's window, or None).

    One type: one group (the windowed block manager when it has a window). Several: groups of
    ``g`` = the greatest common divisor of the types' layer counts (module docstring), types
    in order of their first layer; None when that makes more than MAX_KV_GROUPS groups (e.g.
    15 + 13 layers: 28 groups of one layer, each with its own block table and slot mapping in
    every step's inputs), for which the caller keeps one whole table. Raises ValueError for no
    layers or a window < 1."""
    n = len(layer_windows)
    if n == 0:
        raise ValueError("a model with no layers has no KV cache groups")
    if any(w is not None and w < 1 for w in layer_windows):
        raise ValueError(f"sliding windows must be >= 1: {list(layer_windows)}")
    types: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        types.setdefault(w, []).append(i)
    if len(types) == 1:
        (w,) = types
        return KVCacheGroups((w,), (0,) * n, tuple(range(n)), n)
    g = math.gcd(*(len(layers) for layers in types.values()))
    if n // g > MAX_KV_GROUPS:
        return None
    windows: list[int | None] = []
    group, slot = [0] * n, [0] * n
    for w, layers in types.items():
        for start in range(0, len(layers), g):
            for s, i in enumerate(layers[start:start + g]):
                group[i], slot[i] = len(windows), s
            windows.append(w)
    return KVCacheGroups(tuple(windows), tuple(group), tuple(slot), g)


def interleave(tables: Sequence[Sequence[int]]) -> list[int]:
    """One block-id list per group (all of one length) -> the interleaved list (module
    docstring)."""
    return [i for ids in zip(*tables) for i in ids]


def deinterleave(block_ids: Sequence[int], num_groups: int) -> list[list[int]]:
    """Interleaved block ids (module docstring) -> one list per group."""
    return [list(block_ids[k::num_groups]) for k in range(num_groups)]


class HybridKVCacheManager(PoolAccounting):
    """`KVCacheManager`'s interface over several KV cache groups sharing one `BlockPool`
    (module docstring). ``group_windows``: each group's window in tokens, None for full
    attention (`KVCacheGroups.windows`). Block 0 is the null block when a group is windowed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 group_windows: Sequence[int | None] = (None,)) -> None:
        if not group_windows:
            raise ValueError("group_windows is empty")
        windowed = any(w is not None for w in group_windows)
        self.pool = BlockPool(num_blocks, null_block=windowed)
        self.null_block = self.pool.null_block
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.sliding_window = None  # no single window (the groups have theirs)
        self.groups = [KVCacheManager(num_blocks, block_size, enable_caching, w, self.pool, k)
                       for k, w in enumerate(group_windows)]
        self.stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def block_tables(self) -> dict[str, BlockTable]:
        """Request id -> one `BlockTable` with all of its groups' blocks (group after group):
        for gauges and invariant checks; the groups' own tables are ``groups[k].block_tables``."""
        out: dict[str, BlockTable] = {}
        for grp in self.groups:
            for rid, t in grp.block_tables.items():
                merged = out.get(rid)
                if merged is None:
                    merged = out[rid] = BlockTable()
                merged.blocks.extend(t.blocks[t.num_skipped:])
                merged.block_ids.extend(t.block_ids[t.num_skipped:])
        return out

    # ---- prefix cache -------------------------------------------------------------------------

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash],
                            num_tokens: int) -> list[tuple[KVCacheBlock, ...]]:
        """The longest prefix every group can reuse: a list of ``n`` logical blocks, each the
        tuple of the groups' blocks (null-block entries behind a window). Empty without
        caching or without a hit."""
        if not self.enable_caching:
            return []
        n = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        while n > 0:
            hits = [g.get_computed_blocks(block_hashes, n * self.block_size + 1)
                    for g in self.groups]
            shortest = min(len(h) for h in hits)
            if shortest == n:
                return list(zip(*hits))
            n = shortest  # a shorter hit may need other blocks of a windowed group: look again
        return []

    def num_cached_prefix_blocks(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        """How many leading blocks the first full-attention group has cached (every group's
        own count when none is full: the smallest), assuming the first ``start`` are."""
        full = [g for g in self.groups if g.sliding_window is None]
        return min(g.num_cached_prefix_blocks(block_hashes, start) for g in (full[:1] or
                                                                              self.groups))

    # ---- allocation ---------------------------------------------------------------------------

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request holds at once: the sum of its groups'."""
        return sum(g.max_blocks_held(num_tokens, max_step_tokens) for g in self.groups)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return sum(g.blocks_needed(request_id, num_tokens) for g in self.groups)

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[tuple[KVCacheBlock, ...]] = (),
        block_hashes: Sequence[BlockHash] = (),
        num_computed_tokens: int = 0,
    ) -> list[int] | None:
        """`KVCacheManager.allocate_slots` for every group at once, all or nothing: the new
        logical blocks' ids interleaved (module docstring), or None when the groups together
        need more free blocks than there are (the blocks behind the windows are returned
        first either way). ``new_computed_blocks``: `get_computed_blocks`' tuples."""
        groups = self.groups
        if not new_computed_blocks:  # every group's table has one logical length: group 0's
            t0 = groups[0].block_tables.get(request_id)  # says whether any group needs blocks
            if t0 is not None and num_tokens <= len(t0.blocks) * self.block_size:
                for g in groups:  # the decode step: windows slide, full blocks get hashed
                    g.allocate_slots(request_id, num_tokens, (), block_hashes,
                                     num_computed_tokens)
                return []
        hits = [[t[k] for t in new_computed_blocks] for k in range(len(groups))]
        for g in groups:
            g.release_behind_window(request_id, num_computed_tokens)
        need = sum(g.blocks_to_take(request_id, num_tokens, h) for g, h in zip(groups, hits))
        if need > self.num_free_blocks:
            return None
        null = self.null_block
        self.pool.touch(b for h in hits for b in h if b is not null)  # out of the free queue
        new = [g.allocate_slots(request_id, num_tokens, h, block_hashes, num_computed_tokens,
                                hits_touched=True) for g, h in zip(groups, hits)]
        return interleave(new)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block tables, interleaved (a new list)."""
        return interleave([g.block_ids(request_id) for g in self.groups])

    def free(self, request_id: str) -> None:
        """Return every block of the request, in every group. Unknown ids: a no-op."""
        for g in reversed(self.groups):
            g.free(request_id)
