"""The block manager: `BlockPool` and `KVCacheManager` (pure Python, no tensors, no torch).

The KV cache is split into fixed-size blocks of ``block_size`` token slots (PagedAttention,
Kwon et al., SOSP 2023). A request owns a list of block ids, its *block table*; token ``i`` of a
request lives in slot ``block_table[i // block_size] * block_size + i % block_size``. The model
runner owns the tensors; this module only hands out ids.

Prefix caching (the design of vLLM v1's KV cache manager): a full block is identified by a hash
chained over the blocks before it, ``hash(parent_hash, token_ids, extra_keys)`` (SHA-256, with a
random per-process seed as the root so hashes cannot be predicted across processes or tenants;
a request's ``cache_salt`` goes into the extra keys of its first block; core/block_hash.py). A
hit also compares the block's token ids and parent digest, so even a digest collision is a
miss. A new request reuses the longest run of cached blocks matching its prompt (ref count + 1)
and computes only the rest.
Freed blocks keep their hash and go to the back of a doubly linked free queue in LRU order with
O(1) removal (vLLM's ``FreeKVCacheBlockQueue``); they are evicted lazily, only when handed out
again, and can be revived by a hit until then.

Sliding-window attention (every layer windowed, ``sliding_window`` set; core/kv_window.py has
the rule): blocks that fell wholly behind the window go back to the free queue as the request
advances, hashed as they are, so that they stay prefix-cache hits until evicted (a hit can
only find a block whose content is still there: eviction drops the hash). Their entries in the
block table become the *null block* (vLLM v1's ``null_block``: block 0, taken out of the free
queue for good, never written, never hashed); the attention backends read a windowed request
from the first block inside the window on, so they never read a skipped entry. A request then
holds O(window) blocks, not O(length). Models with full-attention layers get no window here
(their full layers read every block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .block_hash import BlockHash, same_prefix
from .kv_window import cdiv, max_blocks_held, num_skipped_blocks, window_hit

@dataclass(eq=False)
class KVCacheBlock:
    """One block: its id, how many requests use it, its hash once full, and its links in the
    free queue."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    cache_group: int = 0  # the KV cache group whose prefix cache holds it (core/kv_hybrid.py)
    prev_free: "KVCacheBlock | None" = None
    next_free: "KVCacheBlock | None" = None

    def __repr__(self) -> str:
        cached = ", cached" if self.block_hash is not None else ""
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the front (least recently freed), append at
    the back, remove any block in O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        b = self._head.next_free
        if b is self._tail or b is None:
            raise IndexError("no free block")
        self.remove(b)
        return b

    def append(self, b: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = b
        b.prev_free = last
        b.next_free = self._tail
        self._tail.prev_free = b
        self.num_free += 1

    def remove(self, b: KVCacheBlock) -> None:
        if b.prev_free is None or b.next_free is None:
            raise ValueError(f"{b} is not in the free queue")
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        """Free block ids, front (next to be handed out) first. O(n): tests and debugging."""
        out, b = [], self._head.next_free
        while b is not None and b is not self._tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    """All blocks of the cache: ref counts, the free queue and the hash -> block maps, one per
    KV cache group (``group``: 0 unless several groups share the pool, core/kv_hybrid.py; the
    same prompt block is a different cache entry in each group)."""

    def __init__(self, num_blocks: int, null_block: bool = False) -> None:
        if num_blocks < 1 + null_block:
            raise ValueError(f"num_blocks={num_blocks} must be >= {1 + null_block}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block 0 as the null block: the entry of a skipped (behind-the-window) block
        self.null_block = self.blocks[0] if null_block else None
        self.num_usable = num_blocks - null_block
        self.free_queue = FreeBlockQueue(self.blocks[int(null_block):])
        self.cached: dict[BlockHash, KVCacheBlock] = {}  # group 0's
        self._cached_of_group = [self.cached]
        self.num_evictions = 0  # lets callers know when a cached prefix may have shrunk
        self.num_cached_inserts = 0  # ... or grown

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks (ref count 1 each), evicting their cached hashes.
        Raises ValueError if fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: KVCacheBlock) -> None:
        cached = self._cached_of_group[b.cache_group]
        if cached.get(b.block_hash) is b:
            del cached[b.block_hash]
        b.block_hash = None
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a user to each (cache-hit) block, reviving it from the free queue if unused."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; a block reaching 0 goes to the back of the queue
        (still hashed: it can be revived until it is handed out again).

        Pass blocks in the order they should be evicted (callers free a request's blocks
        tail first, so its prefix outlives its suffix).
        """
        for b in blocks:
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache_block(self, b: KVCacheBlock, block_hash: BlockHash, group: int = 0) -> None:
        """Register a full block under its hash in ``group``'s map. A hash already cached there
        (the same content computed twice) keeps its first block; this one stays unhashed."""
        while group >= len(self._cached_of_group):
            self._cached_of_group.append({})
        cached = self._cached_of_group[group]
        if b.block_hash is not None or block_hash in cached:
            return
        b.block_hash = block_hash
        b.cache_group = group
        cached[block_hash] = b
        self.num_cached_inserts += 1

    def lookup(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        if group:
            return (self._cached_of_group[group].get(block_hash)
                    if group < len(self._cached_of_group) else None)
        return self.cached.get(block_hash)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (the null block left out) in use, 0.0 to 1.0."""
        return 1.0 - self.num_free_blocks / self.num_usable


@dataclass
class PrefixCacheStats:
    """Token counts for the hit rate: queries = prompt tokens looked up, hits = found cached.
    The scheduler records a lookup once per admission, and not for a request recomputing after
    preemption."""

    queries: int = 0
    hits: int = 0


class PoolAccounting:
    """The counters both block managers (this module's and core/kv_hybrid.py's) read off their
    ``pool`` and ``stats``, and ``can_allocate`` over their ``blocks_needed``."""

    pool: BlockPool
    stats: PrefixCacheStats

    @property
    def num_blocks(self) -> int:
        """Blocks that requests can hold (the null block left out)."""
        return self.pool.num_usable

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= self.num_free_blocks


@dataclass(eq=False)
class BlockTable:
    """One request's blocks in the `KVCacheManager`: ``blocks`` in table order, ``block_ids``
    the same table as ints (handed to the runner as is, no copy per step), and
    ``num_cached_blocks``, how many leading blocks are registered in the prefix cache;
    ``num_skipped``: how many leading entries are the null block (skipped behind the window)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_skipped: int = 0

    def extend(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.blocks.extend(blocks)
        self.block_ids.extend(b.block_id for b in blocks)


class KVCacheManager(PoolAccounting):
    """Gives requests the blocks they need, step by step, and takes them back.

    ``get_computed_blocks(hashes, num_tokens)`` finds a new request's cached prefix;
    ``allocate_slots(request_id, num_tokens, new_computed_blocks, block_hashes)`` grows its block
    table to cover ``num_tokens`` tokens and registers blocks that are now full;
    ``free(request_id)`` returns all of its blocks. Each request has one `BlockTable` in
    ``block_tables`` while it holds blocks.

    ``sliding_window``: tokens every layer attends over (the module docstring), or None (full
    attention on some layer: nothing is skipped). It reserves block 0 as the null block.
    ``pool`` and ``group``: the shared `BlockPool` and this manager's KV cache group when it
    manages one group of a hybrid model (core/kv_hybrid.py; the pool then has the null block
    if any group is windowed); by default a pool of its own.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 sliding_window: int | None = None, pool: BlockPool | None = None,
                 group: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.group = group
        self.pool = pool if pool is not None else BlockPool(
            num_blocks, null_block=sliding_window is not None)
        if sliding_window is not None and self.pool.null_block is None:
            raise ValueError("a windowed group needs a pool with the null block")
        self.null_block = self.pool.null_block
        self.block_tables: dict[str, BlockTable] = {}
        self.stats = PrefixCacheStats()

    # ---- prefix cache -------------------------------------------------------------------------

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash],
                            num_tokens: int) -> list[KVCacheBlock]:
        """The longest cached prefix of a request, as blocks (not yet touched).

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always computed,
        since its logits are needed. With a sliding window only the blocks inside the window of
        the first token to compute must be cached, and only those (and misses after them) are
        looked up (`window_hit`); the entries before them are the null block.
        """
        if not self.enable_caching:
            return []
        limit = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        if self.sliding_window is not None:  # looks up only the blocks a hit can use
            group = self.group
            n, found = window_hit(lambda i: self.pool.lookup(block_hashes[i], group), limit,
                                  self.sliding_window, self.block_size)
            skipped = n - len(found)
            if found and not same_prefix(found[0].block_hash, block_hashes, skipped):
                return []  # the blocks before the window differ (digests that collide)
            return [self.null_block] * skipped + found
        hits, group = [], self.group
        for h in block_hashes[:limit]:
            b = self.pool.lookup(h, group)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_cached_prefix_blocks(self, block_hashes: Sequence[BlockHash], start: int = 0) -> int:
        """How many leading blocks are cached, assuming the first ``start`` are (no counting)."""
        n = start
        while n < len(block_hashes) and self.pool.lookup(block_hashes[n], self.group) is not None:
            n += 1
        return n

    # ---- allocation ---------------------------------------------------------------------------

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once when a step computes
        at most ``max_step_tokens`` of its tokens (core/kv_window.py)."""
        return max_blocks_held(num_tokens, self.sliding_window, self.block_size,
                               max_step_tokens)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs so that its table covers ``num_tokens`` tokens."""
        table = self.block_tables.get(request_id)
        have = len(table.blocks) if table is not None else 0
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        block_hashes: Sequence[BlockHash] = (),
        num_computed_tokens: int = 0,
        hits_touched: bool = False,
    ) -> list[int] | None:
        """Grow the block table to cover ``num_tokens`` tokens in total.

        ``new_computed_blocks``: cache hits found for a request being admitted; they head its
        table (null-block entries among them stay null). ``block_hashes``: the request's
        full-block hashes, for registering the blocks that this allocation fills (a block is
        full once the tokens scheduled so far cover it). ``num_computed_tokens``: the request's
        tokens computed before this step; with a sliding window the blocks wholly behind the
        window of the first one to compute are returned to the pool first (O(1) amortized).
        Returns the ids of the newly taken blocks, or None when too few blocks are free
        (nothing is taken then; skipped blocks stay returned). ``hits_touched``: the caller
        has already added this request as a user of the hits (`BlockPool.touch`; the hybrid
        manager does so for every group's hits before any group takes new blocks, which could
        otherwise be another group's hits, still in the free queue).
        """
        table = self.block_tables.get(request_id)
        self._release_behind_window(table, num_computed_tokens)
        held = len(table.blocks) if table is not None else 0
        if not new_computed_blocks and num_tokens <= held * self.block_size:
            # the common decode step: the table already covers it (no pool work)
            if (table is not None and self.enable_caching and block_hashes
                    and num_tokens // self.block_size > table.num_cached_blocks):
                self._cache_full_blocks(table, block_hashes, num_tokens)
            return []
        if self.blocks_to_take(request_id, num_tokens, new_computed_blocks) > self.num_free_blocks:
            return None
        need = max(0, cdiv(num_tokens, self.block_size) - held - len(new_computed_blocks))
        null = self.null_block
        hits = [b for b in new_computed_blocks if b is not null]
        if hits and not hits_touched:
            self.pool.touch(hits)
        new = self.pool.get_new_blocks(need)
        if table is None:
            table = self.block_tables[request_id] = BlockTable()
        table.extend(new_computed_blocks)
        table.extend(new)
        if len(hits) < len(new_computed_blocks):
            table.num_skipped = len(new_computed_blocks) - len(hits)
        if self.enable_caching and block_hashes:
            self._cache_full_blocks(table, block_hashes, num_tokens)
        return [b.block_id for b in new]

    def blocks_to_take(self, request_id: str, num_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> int:
        """Free blocks that `allocate_slots` would take from the pool now: new ones, and cache
        hits that nobody holds (revived from the free queue)."""
        table = self.block_tables.get(request_id)
        held = len(table.blocks) if table is not None else 0
        need = max(0, cdiv(num_tokens, self.block_size) - held - len(new_computed_blocks))
        null = self.null_block
        return need + sum(1 for b in new_computed_blocks if b is not null and b.ref_cnt == 0)

    def release_behind_window(self, request_id: str, num_computed_tokens: int) -> None:
        """With a sliding window: return the request's blocks wholly behind the window of its
        first token to compute, ``num_computed_tokens`` (`allocate_slots` does it first)."""
        self._release_behind_window(self.block_tables.get(request_id), num_computed_tokens)

    def _release_behind_window(self, table: BlockTable | None, num_computed_tokens: int) -> None:
        if (table is not None and self.sliding_window is not None
                and num_computed_tokens >= self.sliding_window + self.block_size - 1):
            self._skip_blocks(table, num_computed_tokens)

    def _cache_full_blocks(self, table: BlockTable, block_hashes: Sequence[BlockHash],
                           num_tokens: int) -> None:
        done = table.num_cached_blocks
        full = min(num_tokens // self.block_size, len(block_hashes), len(table.blocks))
        for i in range(max(done, table.num_skipped), full):
            self.pool.cache_block(table.blocks[i], block_hashes[i], self.group)
        if full > done:
            table.num_cached_blocks = full

    def _skip_blocks(self, table: BlockTable, num_computed_tokens: int) -> None:
        """Return the blocks wholly behind the window of position ``num_computed_tokens``
        (oldest first), their table entries becoming the null block."""
        skip = min(num_skipped_blocks(num_computed_tokens, self.sliding_window, self.block_size),
                   len(table.blocks))
        done = table.num_skipped
        if skip <= done:
            return
        null = self.null_block
        gone = table.blocks[done:skip]
        table.blocks[done:skip] = [null] * (skip - done)
        table.block_ids[done:skip] = [null.block_id] * (skip - done)
        table.num_skipped = skip
        self.pool.free_blocks(gone)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids. The list is the manager's own (no copy per
        step): read it before the next allocation, never change it."""
        table = self.block_tables.get(request_id)
        return table.block_ids if table is not None else []

    def free(self, request_id: str) -> None:
        """Return every block of the request (tail first). Freeing an unknown id is a no-op."""
        table = self.block_tables.pop(request_id, None)
        if table is not None and len(table.blocks) > table.num_skipped:
            self.pool.free_blocks(reversed(table.blocks[table.num_skipped:]))
