"""The block manager: `BlockPool` and `KVCacheManager` (pure Python, no tensors, no torch).

The KV cache is split into fixed-size blocks of ``block_size`` token slots (PagedAttention,
Kwon et al., SOSP 2023). A request owns a list of block ids, its *block table*; token ``i`` of a
request lives in slot ``block_table[i // block_size] * block_size + i % block_size``. The model
runner owns the tensors; this module only hands out ids.

Free blocks sit in a doubly linked queue in LRU order with O(1) removal from the middle (the
layout of vLLM v1's ``FreeKVCacheBlockQueue``), so a later prefix cache can revive a freed block
that still holds useful KV without scanning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(eq=False)
class KVCacheBlock:
    """One block: its id, how many requests use it, and its links in the free queue."""

    block_id: int
    ref_cnt: int = 0
    prev_free: "KVCacheBlock | None" = None
    next_free: "KVCacheBlock | None" = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


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
    """All blocks of the cache, with ref counts and the free queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks (ref count 1 each). Raises ValueError if fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            b.ref_cnt = 1
            out.append(b)
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; a block reaching 0 goes to the back of the queue.

        Pass blocks in the order they should be evicted (callers free a request's blocks
        tail first, so its prefix outlives its suffix).
        """
        for b in blocks:
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives requests the blocks they need, step by step, and takes them back.

    ``allocate_slots(request_id, num_tokens_after_step)`` grows a request's block table to cover
    that many tokens; ``free(request_id)`` returns all of its blocks.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs so that its table covers ``num_tokens`` tokens."""
        have = len(self.req_blocks.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the block table to cover ``num_tokens`` tokens in total.

        Returns the ids of the newly taken blocks (possibly empty), or None when too few blocks
        are free (nothing is taken then).
        """
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.num_free_blocks:
            return None
        new = self.pool.get_new_blocks(need)
        self.req_blocks.setdefault(request_id, []).extend(new)
        return [b.block_id for b in new]

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def free(self, request_id: str) -> None:
        """Return every block of the request (tail first). Freeing an unknown id is a no-op."""
        blocks = self.req_blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
