"""Split-K for GEMV-shaped products without extra launches: ``SPLIT_K`` programs share the K
range of an output tile, each writes its fp32 partial sum to a workspace ``[SPLIT_K, M, tiles
* BLOCK_N]``, and the program that arrives last (an atomic counter per output tile) adds the
partials in a fixed order, writes the tile in the output dtype and resets its counter to 0 for
the next launch. No zero-filled buffer, no atomics on the output, no cast kernel: one launch per
product (at batch 1 a decoder layer is a handful of small products, and each extra launch costs
a few microseconds). Counters are shared by the launches on a device: launch on one stream
only. The same epilogue applies SiLU-and-mul to a gate/up product (``GATED``): a decode step's
MLP then has no activation kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def counter_buffer(device: torch.device) -> torch.Tensor:
    """The device's split-K counters (int32, zero; each launch leaves them at zero). Allocated at
    the first launch on the device, which must not be inside CUDA-graph capture (the engine's
    warm-up runs every graphed size eagerly first)."""
    buf = _counters.get(device)
    if buf is None:
        buf = _counters[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return buf


def counters_ready(device: torch.device) -> bool:
    """Whether the device's counters exist (`counter_buffer` may be called under CUDA-graph
    capture only then)."""
    return device in _counters


@triton.jit
def gemv_columns(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """Program ``pid_n``'s weight columns (or rows) ``[BLOCK_N]`` and which are in range. Gated
    (a gate/up product whose epilogue applies SiLU-and-mul: the weight's ``2 * N`` outputs are N
    gate ones then N up ones): gate columns ``pid_n * BLOCK_N/2 + i`` and the same up columns,
    ``N`` further on, so that each program has both inputs of its ``BLOCK_N/2`` outputs."""
    j = tl.arange(0, BLOCK_N)
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        col = pid_n * HALF + j % HALF
        return col + (j // HALF) * N, col < N
    col = pid_n * BLOCK_N + j
    return col, col < N


@triton.jit
def _silu_mul(total, dtype, BLOCK_N: tl.constexpr):
    """``[BLOCK_N]`` fp32 sums (BLOCK_N/2 gates, then their ups) -> silu(gate) * up
    ``[BLOCK_N/2]``, rounded as the unfused path rounds (products to ``dtype``, SiLU in fp32 of
    the rounded gate, rounded, times the rounded up): the same values as SiLU-and-mul
    (core/kernels/activation.py) applied to the product's output."""
    HALF: tl.constexpr = BLOCK_N // 2
    g, u = tl.split(tl.permute(tl.reshape(total, (2, HALF)), (1, 0)))
    g = g.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return s * u.to(dtype).to(tl.float32)


@triton.jit
def splitk_store(res, out_row, ws_ptr, cnt_ptr, pid_k, m, M, N, n_ok,
                 SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """Store this program's fp32 partial ``res`` [BLOCK_N] of row ``m`` (output tile
    ``program_id(0)``, columns from `gemv_columns`) into ``out_row`` (row m's first output):
    directly with SPLIT_K == 1, else through the workspace (``[SPLIT_K, M, tiles * BLOCK_N]``)
    and the last-arrival reduction. ``N``: the outputs; gated, the epilogue stores the tile's
    BLOCK_N/2 outputs silu(gate) * up."""
    pid_n = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    total = res
    if SPLIT_K == 1:
        last = True
    else:
        row_ws = ws_ptr + (pid_k * M + m) * (tl.num_programs(0) * BLOCK_N) + pid_n * BLOCK_N
        tl.store(row_ws + j, res, mask=n_ok)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        cnt = cnt_ptr + m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:  # the last of this tile's programs: add the partials
            total = tl.zeros_like(res)
            step = M * (tl.num_programs(0) * BLOCK_N)
            for p in tl.static_range(SPLIT_K):
                total += tl.load(row_ws + (p - pid_k) * step + j, mask=n_ok, other=0.0,
                                 cache_modifier=".cg")
            tl.atomic_xchg(cnt, 0)
    if last:
        dtype = out_row.dtype.element_ty
        if GATED:
            HALF: tl.constexpr = BLOCK_N // 2
            cols = pid_n * HALF + tl.arange(0, HALF)
            tl.store(out_row + cols, _silu_mul(total, dtype, BLOCK_N).to(dtype), mask=cols < N)
        else:
            tl.store(out_row + pid_n * BLOCK_N + j, total.to(dtype), mask=n_ok)


class GemvLaunch(NamedTuple):
    """What `launch_buffers` prepares for one GEMV launch."""
    x: torch.Tensor  # [M, K], contiguous
    out: torch.Tensor  # [M, n_out] in x's dtype
    ws: torch.Tensor  # fp32 [split_k, M, n_tiles * block_n] (``out`` when split_k == 1)
    cnt: torch.Tensor  # the device's split-K counters (``out`` when split_k == 1)
    n_tiles: int  # output tiles: the grid's first dimension
    n_out: int  # outputs: the weight's N, gated N / 2
    n_even: bool  # n_out a multiple of the outputs per tile (no masks along N)


def launch_buffers(x: torch.Tensor, n: int, block_n: int, split_k: int, what: str,
                   gated: bool = False) -> GemvLaunch:
    """For a GEMV launch over ``x`` [M, K] and a weight of ``n`` outputs (gated: n/2 gate then
    n/2 up ones, and ``n / 2`` outputs, ``block_n / 2`` per tile): see `GemvLaunch`.

    Raises ValueError when split-K needs more counters (M x the output tiles) than there
    are, a gated weight's N is odd, or a gated tile has fewer than 2 columns."""
    m = x.shape[0]
    if gated and n % 2:
        raise ValueError(f"{what}: a gated weight has gate and up outputs, N={n} is odd")
    if gated and block_n < 2:
        raise ValueError(f"{what}: a gated product needs block_n >= 2, got {block_n}")
    n_out, per_tile = (n // 2, block_n // 2) if gated else (n, block_n)
    n_tiles = triton.cdiv(n_out, per_tile)
    if split_k > 1 and m * n_tiles > MAX_COUNTERS:
        raise ValueError(f"{what}: M={m} x {n_tiles} output tiles exceeds {MAX_COUNTERS} "
                         f"split-K counters")
    x = x.contiguous()
    out = torch.empty(m, n_out, device=x.device, dtype=x.dtype)
    if split_k == 1:
        return GemvLaunch(x, out, out, out, n_tiles, n_out, n_out % per_tile == 0)
    ws = torch.empty(split_k, m, n_tiles * block_n, device=x.device, dtype=torch.float32)
    return GemvLaunch(x, out, ws, counter_buffer(x.device), n_tiles, n_out,
                      n_out % per_tile == 0)
