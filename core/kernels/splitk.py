"""Split-K for GEMV-shaped products without extra launches: ``SPLIT_K`` programs share the K
range of an output tile, each writes its fp32 partial sum to a workspace ``[SPLIT_K, M, N]``,
and the program that arrives last (an atomic counter per output tile) adds the partials in a
fixed order, writes the tile in the output dtype and resets its counter to 0 for the next
launch. No zero-filled buffer, no atomics on the output, no cast kernel: one launch per product
(at batch 1 a decoder layer is a handful of small products, and each extra launch costs a few
microseconds). Counters are shared by the launches on a device: launch on one stream only.
"""

from __future__ import annotations

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
def splitk_store(res, out_ptrs, n_ok, ws_ptr, cnt_ptr, pid_k, m, M, N, offs_n,
                 SPLIT_K: tl.constexpr):
    """Store this program's fp32 partial ``res`` [BLOCK_N] of row ``m`` (output tile
    ``program_id(0)``): directly with SPLIT_K == 1, else through the workspace and the
    last-arrival reduction."""
    if SPLIT_K == 1:
        tl.store(out_ptrs, res.to(out_ptrs.dtype.element_ty), mask=n_ok)
    else:
        tl.store(ws_ptr + (pid_k * M + m) * N + offs_n, res, mask=n_ok)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        cnt = cnt_ptr + m * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last of this tile's programs: add the partials
            total = tl.zeros_like(res)
            for p in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + (p * M + m) * N + offs_n, mask=n_ok, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(cnt, 0)


def launch_buffers(x: torch.Tensor, n: int, block_n: int, split_k: int, what: str):
    """For a GEMV launch over ``x`` [M, K]: (x contiguous, out [M, n] in x's dtype, workspace,
    counters, number of output tiles). The workspace is fp32 ``[split_k, M, n]`` and the
    counters the device's (both ``out`` placeholders when ``split_k == 1``).

    Raises ValueError when split-K needs more counters (M x the output tiles) than there
    are."""
    m = x.shape[0]
    n_tiles = triton.cdiv(n, block_n)
    if split_k > 1 and m * n_tiles > MAX_COUNTERS:
        raise ValueError(f"{what}: M={m} x {n_tiles} output tiles exceeds {MAX_COUNTERS} "
                         f"split-K counters")
    x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if split_k == 1:
        return x, out, out, out, n_tiles
    ws = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
    return x, out, ws, counter_buffer(x.device), n_tiles
