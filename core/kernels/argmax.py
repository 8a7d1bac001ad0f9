"""Row-wise argmax for greedy sampling: ``x.argmax(dim=-1)`` in one launch that spreads each row
over many programs. torch's reduction gives one row one thread block: at batch 1 over a 128K
vocabulary that is ~27 us of an H200 decode step (docs/benchmarks.md, session 5's TP trace),
where the read itself takes well under one.

Each program scans a chunk of its row and writes its (max, first index); the last program of the
row to finish (an atomic counter per row, core/kernels/splitk.py's scheme) picks the largest,
the lowest index on ties. Semantics as torch.argmax: the first maximal index; NaN counts as
larger than every number (the first NaN wins); a row of -inf gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .splitk import MAX_COUNTERS, counter_buffer

MAX_CHUNK = 4096  # elements per program at most


@triton.jit
def _better(v, i, best_v, best_i):
    """Whether (v, i) beats (best_v, best_i): NaN above all, then larger, then lower index."""
    v_nan = v != v
    b_nan = best_v != best_v
    return (v_nan & (~b_nan | (i < best_i))) | (~v_nan & ~b_nan & (
        (v > best_v) | ((v == best_v) & (i < best_i))))


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, val_ptr, idx_ptr, cnt_ptr, V, stride_x,
                   SPLITS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * CHUNK
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for off in tl.static_range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=idx < V,
                    other=float("-inf")).to(tl.float32)
        idx = tl.where(idx < V, idx, 2147483647)
        take = _better(v, idx, best_v, best_i)
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, idx, best_i)
    # this program's winner: the element that beats every other (a tree over BLOCK lanes)
    v_max = tl.max(tl.where(best_v != best_v, float("inf"), best_v), axis=0)
    has_nan = tl.max((best_v != best_v).to(tl.int32), axis=0) > 0
    hit = tl.where(has_nan, best_v != best_v, best_v == v_max)
    i_win = tl.min(tl.where(hit, best_i, 2147483647), axis=0)
    v_win = tl.where(has_nan, float("nan"), v_max)
    if SPLITS == 1:
        tl.store(out_ptr + row, tl.where(i_win == 2147483647, 0, i_win).to(tl.int64))
    else:
        tl.store(val_ptr + row * SPLITS + part, v_win)
        tl.store(idx_ptr + row * SPLITS + part, i_win)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
        if arrived == SPLITS - 1:  # the row's last program: merge the SPLITS winners
            offs = tl.arange(0, SPLITS)
            pv = tl.load(val_ptr + row * SPLITS + offs, cache_modifier=".cg")
            pi = tl.load(idx_ptr + row * SPLITS + offs, cache_modifier=".cg")
            p_nan = pv != pv
            any_nan = tl.max(p_nan.to(tl.int32), axis=0) > 0
            pmax = tl.max(tl.where(p_nan, float("inf"), pv), axis=0)
            phit = tl.where(any_nan, p_nan, pv == pmax)
            win = tl.min(tl.where(phit, pi, 2147483647), axis=0)
            tl.store(out_ptr + row, tl.where(win == 2147483647, 0, win).to(tl.int64))
            tl.atomic_xchg(cnt_ptr + row, 0)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of x ``[n, V]`` (fp32/bf16/fp16, last dim contiguous) -> ``[n]``
    int64, torch's tie and NaN rules. Raises ValueError for more rows than split counters."""
    n, v = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    chunk = min(MAX_CHUNK, triton.next_power_of_2(v))
    splits = triton.next_power_of_2(triton.cdiv(v, chunk))
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    if n > MAX_COUNTERS:
        raise ValueError(f"argmax_rows: {n} rows exceed {MAX_COUNTERS} counters")
    vals = torch.empty(n * splits, dtype=torch.float32, device=x.device)
    idxs = torch.empty(n * splits, dtype=torch.int32, device=x.device)
    _argmax_kernel[(n, splits)](x, out, vals, idxs, counter_buffer(x.device), v, x.stride(0),
                                SPLITS=splits, BLOCK=min(chunk, 1024), CHUNK=chunk,
                                num_warps=4)
    return out
