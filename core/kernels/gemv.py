"""A 16-bit dense GEMV for batch-1 decode: ``x @ W^T (+ bias)`` for a few rows of x, with W
``[N, K]`` as nn.Linear keeps it.

At batch 1 a linear layer reads its whole weight to produce one row: the time is the weight
read. cuBLAS' kernels for these skinny shapes reached about 70 % of the H200's copy bandwidth
(docs/benchmarks.md); this kernel is a plain streaming GEMV: each program reads a
``[BLOCK_N, BLOCK_K]`` tile of W per step (contiguous along K, so 16-byte loads), multiplies by
the matching slice of x and accumulates in fp32, reducing over K once at the end; split-K
(core/kernels/splitk.py) spreads the K range over more programs when N alone does not fill the
GPU. Whether it beats cuBLAS is a per-GPU, per-shape measurement: the layers use it only where
a tuned table (core/kernels/tuned.py, kernel ``dense_gemv``) says so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .splitk import gemv_columns, launch_buffers, splitk_store


@triton.jit
def _w_tile(w_rows, kt, n_ok, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """K tile ``kt`` of the program's weight rows: ``[BLOCK_N, BLOCK_K]``."""
    offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
    if EVEN:
        return tl.load(w_rows + offs_k[None, :])
    return tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :],
                   other=0.0)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                 stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                 SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN: tl.constexpr, PREFETCH: tl.constexpr, GATED: tl.constexpr,
                 PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n, n_ok = gemv_columns(pid_n, N, BLOCK_N, GATED)  # weight rows
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_start = pid_k * per_split
    kt_end = tl.minimum(kt_start + per_split, k_tiles)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if PREFETCH:  # the next tile is loaded before this one is used (clamped into range); with
        # PDL the first one is read while the previous kernel finishes (no kernel writes W)
        w_n = _w_tile(w_rows, tl.minimum(kt_start, k_tiles - 1), n_ok, K, BLOCK_K, EVEN)
    pdl.wait(PDL)
    for kt in range(kt_start, kt_end):
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        if PREFETCH:
            w = w_n
            w_n = _w_tile(w_rows, tl.minimum(kt + 1, kt_end - 1), n_ok, K, BLOCK_K, EVEN)
        else:
            w = _w_tile(w_rows, kt, n_ok, K, BLOCK_K, EVEN)
        if EVEN:
            x = tl.load(x_ptr + m * stride_xm + offs_k).to(tl.float32)
        else:
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0)
            x = x.to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    pdl.launch_dependents(PDL)
    res = tl.sum(acc, axis=1)
    if HAS_BIAS:  # added once: by the first split's program (its partial goes in the sum)
        if pid_k == 0:
            res += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    splitk_store(res, out_ptr + m * stride_om, ws_ptr, cnt_ptr, pid_k, m, M, N, n_ok, SPLIT_K,
                 BLOCK_N, GATED)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         block_n: int, block_k: int, split_k: int = 1, prefetch: bool = False,
         gated: bool = False, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """``x @ weight^T (+ bias)``: x ``[M, K]`` and weight ``[N, K]`` (K contiguous in both)
    fp16/bf16/fp32, bias ``[N]`` or None -> ``[M, N]`` in x's dtype, fp32 accumulation.
    ``prefetch``: each K tile of W is loaded one iteration ahead. Loads are unmasked when K and
    N are multiples of the tile. ``gated``: W's rows are N/2 gate then N/2 up ones (Llama's
    fused gate_up_proj) and the result is SiLU-and-mul of the product, ``[M, N/2]``, each
    output tile then holding ``block_n / 2`` outputs (splitk.py).

    Raises ValueError when the shapes or dtypes disagree, a gated weight has an odd number of
    rows, or the split-K counters would not fit (M * N / block_n > 65536)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not "
                         f"[M, K] and [N, K]")
    if weight.dtype != x.dtype or weight.stride(1) != 1:
        raise ValueError(f"gemv: weight {weight.dtype} stride {weight.stride()} must be x's "
                         f"dtype {x.dtype} with unit stride along K")
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and (bias.numel() != n or not bias.is_contiguous()):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} is not contiguous [N={n}]")
    b = launch_buffers(x, n, block_n, split_k, "gemv", gated)
    _gemv_kernel[(b.n_tiles, split_k, m)](
        b.x, weight, bias if bias is not None else weight, b.out, b.ws, b.cnt, m, b.n_out, k,
        b.x.stride(0), weight.stride(0), b.out.stride(0), HAS_BIAS=bias is not None,
        SPLIT_K=split_k, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=k % block_k == 0 and b.n_even, PREFETCH=bool(prefetch), GATED=bool(gated),
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(x.device))
    return b.out
