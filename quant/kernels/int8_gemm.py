"""W8A8 GEMM with the scales fused into its epilogue:

    out[m, n] = float(sum_k xq[m, k] * w[n, k]) * x_scale[m] * w_scale[n] (+ bias[n])

xq int8 [M, K] (per-token quantized activations), w int8 [N, K] as the checkpoint stores it
(row-major, K contiguous). Each program accumulates one [BLOCK_M, BLOCK_N] tile in int32 with
``tl.dot(int8, int8, out_dtype=tl.int32)``; the weight tile is loaded as [BLOCK_N, BLOCK_K] and
transposed in registers, so B is K-major, as Hopper's int8 wgmma needs. The int32 result is
scaled in fp32 and written once in the output dtype (no int32 / fp32 copy of the product).
Programs are ordered in groups of ``GROUP_M`` row tiles (the Triton matmul tutorial's
swizzle) so that neighbouring programs share weight tiles in L2.

`pick_int8_config` is a heuristic, to be checked on the target GPU with an explicit-config sweep
through `int8_scaled_mm`'s keyword arguments. Runs under ``TRITON_INTERPRET=1`` too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                      stride_am, stride_bn, stride_cm,
                      HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past M / N re-read valid ones (no load masks); their results are not stored
    rows_a = offs_m % M
    rows_b = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k[None, :] < K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok, other=0)
            b = tl.load(b_ptrs, mask=k_ok, other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    m_ok = offs_m < M
    n_ok = offs_n < N
    a_s = tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)
    b_s = tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)
    out = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


MIN_BLOCK_K = 32  # int8 mma is m16n8k32; a 16-wide K tile summed wrongly on the H200 (tests)


def pick_int8_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes, warps and stages for an [m, k] x [n, k]^T int8 product (heuristic; sweep
    on the target GPU). From 64 rows on the tiles are wgmma-sized (Hopper)."""
    if m <= 16:
        return dict(block_m=16, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4)
    if m <= 128:
        return dict(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=4)
    return dict(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)


def int8_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                   w_scale: torch.Tensor, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None, *, block_m: int | None = None,
                   block_n: int | None = None, block_k: int | None = None,
                   group_m: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> torch.Tensor:
    """``(xq @ w.T) * x_scale * w_scale (+ bias)`` -> [M, N] in ``out_dtype``.

    xq: int8 [M, K], unit stride along K. x_scale: fp32 [M, 1] or [M] (contiguous).
    w: int8 [N, K], unit stride along K. w_scale: fp32 [N] (contiguous). bias: [N] or None,
    added in fp32 before the cast. out_dtype: bfloat16 / float16 / float32.
    Config keywords left None come from `pick_int8_config` (block sizes powers of two, block_m
    at least 16 and block_k at least 32 for the int8 ``tl.dot``).
    Raises ValueError for wrong dtypes, shapes or strides (naming the value).
    """
    if xq.dtype != torch.int8 or w.dtype != torch.int8:
        raise ValueError(f"int8_scaled_mm: xq {xq.dtype} and w {w.dtype} must be torch.int8")
    if xq.dim() != 2 or w.dim() != 2 or xq.shape[1] != w.shape[1]:
        raise ValueError(f"int8_scaled_mm: xq {tuple(xq.shape)} and w {tuple(w.shape)} are not "
                         f"[M, K] and [N, K]")
    m, k = xq.shape
    n = w.shape[0]
    if (k > 1 and (xq.stride(1) != 1 or w.stride(1) != 1)):
        raise ValueError(f"int8_scaled_mm: strides xq {xq.stride()}, w {w.stride()} are not "
                         f"unit along K")
    if x_scale.dtype != torch.float32 or x_scale.numel() != m or not x_scale.is_contiguous():
        raise ValueError(f"int8_scaled_mm: x_scale {x_scale.dtype} {tuple(x_scale.shape)} is "
                         f"not contiguous fp32 with M={m} values")
    if w_scale.dtype != torch.float32 or w_scale.numel() != n or not w_scale.is_contiguous():
        raise ValueError(f"int8_scaled_mm: w_scale {w_scale.dtype} {tuple(w_scale.shape)} is "
                         f"not contiguous fp32 with N={n} values")
    if bias is not None and (bias.numel() != n or not bias.is_contiguous()):
        raise ValueError(f"int8_scaled_mm: bias {tuple(bias.shape)} is not contiguous [N={n}]")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"int8_scaled_mm: out_dtype {out_dtype} is not one of {_OUT_DTYPES}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    cfg = pick_int8_config(m, n, k)
    given = dict(block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                 num_warps=num_warps, num_stages=num_stages)
    cfg.update({key: v for key, v in given.items() if v is not None})
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    if bk < MIN_BLOCK_K:
        raise ValueError(f"int8_scaled_mm: block_k={bk} is below {MIN_BLOCK_K} (the K of one "
                         f"int8 tensor-core instruction; smaller tiles gave wrong sums on an H200)")
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _int8_gemm_kernel[grid](
        xq, w, x_scale, w_scale, bias if bias is not None else w_scale, out, m, n, k,
        xq.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=cfg["group_m"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
