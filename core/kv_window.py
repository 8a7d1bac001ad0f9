"""The sliding-window rule of the block manager: which blocks a windowed request still needs
(pure Python, no torch; core/kv_cache.py applies it).

The window is measured as transformers measures it (``masking_utils.sliding_window_overlay``
with the causal mask): the token at position ``i`` attends to the keys ``j`` with
``i - window < j <= i``, i.e. ``window`` keys, itself included. A request whose next token to
compute is at position ``p`` (= its ``num_computed_tokens``) therefore never reads keys below
``p - window + 1`` again: the blocks wholly below it are *skipped* and go back to the pool
(vLLM v1's ``SlidingWindowManager.remove_skipped_blocks``, whose
``get_num_skipped_tokens(n) = n - sliding_window + 1`` is the same rule).

A request then holds at most ``cdiv(window - 1 + n, block_size) + 1`` blocks while a step
computes ``n`` of its tokens: for a decode (n = 1), ``window / block_size + 2`` at most
(docs/tuning.md).
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_skipped_blocks(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks of a request that no token from position ``num_computed_tokens`` on can
    read: those wholly below ``num_computed_tokens - window + 1``."""
    return max(0, num_computed_tokens - window + 1) // block_size


def max_blocks_held(num_tokens: int, window: int | None, block_size: int,
                    max_step_tokens: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once when a step computes at
    most ``max_step_tokens`` of its tokens: all of them without a window, else the window behind
    a step's first token plus the step's tokens (no more than the whole request)."""
    whole = cdiv(num_tokens, block_size)
    if window is None:
        return whole
    return min(whole, cdiv(window - 1 + max_step_tokens, block_size) + 1)


def window_hit(lookup: Callable[[int], T | None], num_blocks: int, window: int,
               block_size: int) -> tuple[int, list[T]]:
    """The longest prefix-cache hit, in blocks, for a windowed request, and its blocks that the
    first token to compute reads. ``lookup(i)``: the request's block ``i`` (of the
    ``num_blocks`` a hit may cover) if it is cached, else None.

    A hit of ``n`` blocks makes position ``n * block_size`` the first token to compute, which
    reads only the blocks from ``s = num_skipped_blocks(n * block_size)`` on: those must be
    cached, the ones before need not be (their hashes chain into the later ones, so a later
    block's hash names the whole prefix) and are not looked up. Scans from the right as vLLM
    v1's sliding-window hit search does: a miss at block ``i`` rules out every hit longer than
    ``i``, so each block is looked up at most once, and a hit of ``n`` looks up only blocks
    ``s .. num_blocks - 1``. Returns ``(n, [lookup(s), ..., lookup(n - 1)])``; ``(0, [])`` for
    no hit."""
    end = num_blocks  # the longest hit not ruled out yet
    run: list[T] = []  # cached blocks end - 1, end - 2, ... (reversed)
    i = end - 1
    while end > 0:
        if i < num_skipped_blocks(end * block_size, window, block_size):
            run.reverse()
            return end, run
        b = lookup(i)
        if b is None:
            end, run = i, []
        else:
            run.append(b)
        i -= 1
    return 0, []


def window_hit_length(cached: list[bool], window: int, block_size: int) -> int:
    """`window_hit`'s length, from ``cached[i]``: whether the request's block ``i`` (of those a
    hit may cover) is in the cache."""
    return window_hit(lambda i: True if cached[i] else None, len(cached), window,
                      block_size)[0]
