"""The launch rule of the 16-bit GEMV (core/kernels/gemv.py) and the candidates the start-up
autotuner (core/kernels/autotune.py) times around it, for a weight ``[N, K]`` at ``m`` rows of
decode. Configs are the ``dense_gemv`` tables' entries: ``{"kernel": "gemv", block_n, block_k,
split_k, prefetch, num_warps, num_stages}`` or ``{"kernel": "cublas"}`` (``F.linear``).

The rule, from the H200 table (core/kernels/configs/dense_gemv_NVIDIA_H200.json, scripts/
bench_quant.py --only tune-dense, session 6: the GEMV beat cuBLAS at one row on every 8B, 1B and
8B-TP2 shape, by 3-30 %):

- one row: the GEMV. Up to 8192 weight rows (qkv, o, down and their shards) 8-row tiles of 512
  inputs on 8 warps (every such shape but one chose that; 6144 rows took 16-row tiles, a 1 %
  difference); above (gate/up, LM heads) 16-row tiles of 256 inputs on 4 warps;
- split-K only where the tiles alone leave SMs without two programs each (the shapes measured
  all had >= 2 per SM with 8-row tiles and chose no split, but for the 1B down product, whose
  best with 32-row tiles used 4 splits for the same 256 programs): splits = 2 x SMs / tiles,
  snapped to 1, 2, 3, 4, 6, 8 (few distinct SPLIT_K values: each is a compile);
- ``block_k`` the largest of 512 / 256 / 128 dividing K (unmasked loads), else 512 (masked);
- more rows: cuBLAS (nothing measured the GEMV faster there; it reads W once per row).
"""

from __future__ import annotations

from typing import Any

import triton

from .splitk import MAX_COUNTERS

CUBLAS: dict[str, Any] = {"kernel": "cublas"}
SPLITS = (1, 2, 3, 4, 6, 8)
BIG_N = 8192  # weight rows above which tiles are 16 x 256 on 4 warps
MAX_TILE = 16384  # block_n x block_k elements (the sweep's register bound; halved with prefetch)
GEMV_TUNED_ROWS = 4  # the GEMV is a candidate up to this many rows (cuBLAS only above)


def _snap(v: float, allowed: tuple[int, ...]) -> int:
    return min(allowed, key=lambda a: abs(a - v) / a)


def _block_k(k: int, big: bool) -> int:
    for bk in ((256, 512, 128) if big else (512, 256, 128)):
        if k % bk == 0:
            return bk
    return min(512, max(32, triton.next_power_of_2(k)))


def _gemv(n: int, k: int, m: int, sms: int, gated: bool, block_n: int, block_k: int,
          num_warps: int, prefetch: int = 0, split_k: int | None = None) -> dict[str, Any]:
    per_tile = block_n // 2 if gated else block_n
    tiles = triton.cdiv(n // 2 if gated else n, per_tile)
    if split_k is None:
        split_k = 1 if tiles >= 2 * sms else _snap(2 * sms / tiles, SPLITS)
    k_tiles = triton.cdiv(k, block_k)
    split_k = max(1, min(split_k, k_tiles))
    split_k = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split_k))  # no split left empty
    if m * tiles > MAX_COUNTERS:
        split_k = 1
    return dict(kernel="gemv", block_n=block_n, block_k=block_k, split_k=split_k,
                prefetch=prefetch, num_warps=num_warps, num_stages=3)


def rule_config(m: int, n: int, k: int, sms: int, gated: bool = False) -> dict[str, Any]:
    """The rule's config for ``m`` rows of x ``[m, K]`` times W ``[N, K]`` on ``sms`` SMs
    (``gated``: W is N/2 gate then N/2 up rows, SiLU-and-mul in the epilogue)."""
    if m > 1:
        return dict(CUBLAS)
    big = n > BIG_N
    return _gemv(n, k, m, sms, gated, 16 if big else 8, _block_k(k, big), 4 if big else 8)


def candidates(m: int, n: int, k: int, sms: int, gated: bool = False) -> list[dict[str, Any]]:
    """What the autotuner times for this shape at ``m`` rows (the rule's config first, each
    a valid launch): at one row the rule, its neighbours in tile rows, tile inputs, warps,
    split-K and prefetch, and cuBLAS; up to GEMV_TUNED_ROWS rows cuBLAS and the one-row rule's
    GEMV; above, cuBLAS alone."""
    if m > GEMV_TUNED_ROWS:
        return [dict(CUBLAS)]
    one = rule_config(1, n, k, sms, gated)
    if m > 1:
        return [dict(CUBLAS), one]
    bn, bk, w, sk = one["block_n"], one["block_k"], one["num_warps"], one["split_k"]
    out = [one]
    for block_n, block_k, warps, pre, split in (
            (bn * 2, bk, w, 0, None), (max(bn // 2, 2), bk, w, 0, None),
            (bn, 512 if bk != 512 else 256, w, 0, None), (bn, bk, 12 - w, 0, sk),
            (bn, bk, w, 1, sk), (bn, bk, w, 0, 2 * sk if sk > 1 else 2)):
        if block_n * block_k > MAX_TILE >> pre:
            continue
        cfg = _gemv(n, k, m, sms, gated, block_n, block_k, warps, pre, split)
        if cfg not in out:
            out.append(cfg)
    return out + [dict(CUBLAS)]
