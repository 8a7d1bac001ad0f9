"""Prefix-cache keys of full KV blocks (core/kv_cache.py): SHA-256 chained over the blocks
before each, with the preimage kept so that a lookup compares token ids, not only digests."""

from __future__ import annotations

import hashlib
import os
from array import array
from typing import Sequence

_ROOT_HASH = os.urandom(32)  # per-process seed of every hash chain


class BlockHash:
    """A full block's prefix-cache key: ``digest``, SHA-256 chained over the blocks before it,
    and its preimage (``parent``: the parent block's digest or None, ``token_ids``, ``extra``).

    Dict lookups hash the digest; equality also compares the preimage, so a cached block is a
    hit only when it holds exactly these token ids after the same parent digest: two blocks
    whose digests collide are different keys (a forced collision is a miss:
    tests/test_prefix_cache.py). The comparison is one tuple of block_size ints per hit block.
    """

    __slots__ = ("digest", "parent", "token_ids", "extra", "prev")

    def __init__(self, digest: bytes, parent: bytes | None, token_ids: tuple[int, ...],
                 extra: bytes = b"", prev: "BlockHash | None" = None) -> None:
        self.digest, self.parent, self.token_ids, self.extra = digest, parent, token_ids, extra
        self.prev = prev  # the parent block's key: a windowed hit checks the blocks before it

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BlockHash) and self.digest == other.digest
                and self.token_ids == other.token_ids and self.parent == other.parent
                and self.extra == other.extra)

    def __repr__(self) -> str:
        return f"BlockHash({self.digest[:6].hex()}..., {len(self.token_ids)} tokens)"


def _digest(parent: bytes | None, token_ids: Sequence[int], extra: bytes) -> bytes:
    h = hashlib.sha256(parent if parent is not None else _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """The key of a block: SHA-256 over (parent digest, token ids, extra keys), the root parent
    a random seed, with its preimage (`BlockHash`)."""
    p = parent.digest if parent is not None else None
    return BlockHash(_digest(p, token_ids, extra), p, tuple(token_ids), extra, parent)


def same_prefix(cached: "BlockHash | None", hashes: Sequence[BlockHash], i: int) -> bool:
    """Whether the blocks before ``cached`` (the key of a cached block that a lookup matched
    to ``hashes[i]``) hold ``hashes[:i]``'s token ids and extra keys: a sliding-window hit looks
    up only the blocks inside the window, so the ones before it are compared here, through
    the keys' ``prev`` links (one tuple compare per block), not trusted by digest."""
    node = cached.prev if cached is not None else None
    for j in range(i - 1, -1, -1):
        if node is None or node.token_ids != hashes[j].token_ids or node.extra != hashes[j].extra:
            return False
        node = node.prev
    return node is None


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None) -> None:
    """Append the hashes of blocks that became full since ``hashes`` was last extended.

    Each block is hashed once, when it fills. ``token_ids``: the request's prompt + outputs.
    """
    start = len(hashes)
    for i in range(start, len(token_ids) // block_size):
        parent = hashes[i - 1] if i else None
        extra = cache_salt.encode() if (i == 0 and cache_salt) else b""
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
