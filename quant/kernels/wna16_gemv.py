"""Decode-size W4A16 / W8A16 product on CUDA cores (no tensor cores): ``x @ W^T`` for a few rows
of x, over the canonical layout of quant/wna16.py (qweight int32 ``[K * bits / 32, N]`` packed
along K; scales, zeros ``[G, N]``), for layers whose group size is a multiple of the K tile.

At batch 1 the product is a matrix-vector one: the weight read is the whole cost, and the
arithmetic that turns each packed field into a float must keep up with it (on an H200 the
integer pipe is half as wide as the fp32 one). Per 4-bit weight field the kernel does one AND/OR
(a LOP3), one FMA, half a shift and a quarter of a float operation for the per-row corrections:

- one shift of a word puts two fields at bits 15 and 19 (one 8-bit field at bit 15); a field at
  bit ``b`` is masked in place and ORed into the exponent ``150 - b`` of an fp32, which is then
  exactly ``2**(23 - b) + v`` (the "magic number" int-to-float conversion of FasterTransformer /
  AWQ, here in fp32);
- the FMA multiplies x by that float as it is; per row of a K tile (one word's fields) the bases'
  share ``sum x * 2**(23 - b)`` and the zero point's ``z * sum x`` are subtracted before the tile
  is scaled and accumulated, so nothing large accumulates across K (activations with a non-zero
  mean stay exact to fp32 rounding: tests/test_quant_kernels.py);
- the products of one K tile are summed first; its group's scale is applied once per tile.

Split-K without extra launches: core/kernels/splitk.py (the last-arriving program adds the
partials).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagebatch.kernels.splitk import launch_buffers, splitk_store


@triton.jit
def _field(w, BITS: tl.constexpr, OFF: tl.constexpr):
    """The field at bits ``OFF ..`` of each int32 in ``w`` as fp32 ``2**(23 - OFF) + v``
    (exact: the field is the low mantissa bits under exponent ``150 - OFF``)."""
    mask: tl.constexpr = ((1 << BITS) - 1) << OFF
    expo: tl.constexpr = (150 - OFF) << 23
    return ((w & mask) | expo).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M"])
def _wna16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
                       M, N, K, group_size, stride_xm, stride_qk, stride_sg, stride_om,
                       BITS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_KP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    PF: tl.constexpr = 32 // BITS
    # each shifted copy of a word puts PER fields at bits 15 (and 19): the top of the fp32
    # mantissa, where the float bases 2**(23 - off) are smallest (2**8, 2**4)
    PER: tl.constexpr = 2 if BITS == 4 else 1
    BLOCK_K: tl.constexpr = BLOCK_KP * PF
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, BLOCK_KP)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_start = pid_k * per_split
    kt_end = tl.minimum(kt_start + per_split, k_tiles)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_start, kt_end):
        rows = kt * BLOCK_KP + offs_r
        r_ok = rows * PF < K
        q = tl.load(q_ptr + rows[:, None] * stride_qk + offs_n[None, :],
                    mask=r_ok[:, None] & n_ok[None, :], other=0)
        x_base = x_row + rows * PF
        part = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_KP,), dtype=tl.float32)
        x_off = tl.zeros((BLOCK_KP,), dtype=tl.float32)  # sum of x * 2**(23 - off)
        for p in tl.static_range(PF // PER):
            # field p*PER moves from bit 8p to bit 15: a shift by 15 - 8p
            if p <= 1:
                w = q << (15 - 8 * p)
            else:
                w = q >> (8 * p - 15)
            for i in tl.static_range(PER):
                xj = tl.load(x_base + (p * PER + i), mask=r_ok, other=0.0).to(tl.float32)
                part += xj[:, None] * _field(w, BITS, 15 + BITS * i)
                x_sum += xj
                x_off += xj * (1 << (8 - BITS * i))
        g = (kt * BLOCK_K) // group_size
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        # per row of the tile: sum_j x (v - z), the float bases and the zero point taken off
        # before anything accumulates across tiles
        acc += (part - x_off[:, None] - x_sum[:, None] * z[None, :]) * s[None, :]
    res = tl.sum(acc, axis=0)
    splitk_store(res, out_ptr + m * stride_om + offs_n, n_ok, ws_ptr, cnt_ptr, pid_k, m, M, N,
                 offs_n, SPLIT_K)


def gemv_supported(bits: int, group_size: int, block_kp: int, has_g_idx: bool) -> bool:
    """Whether the GEMV kernel takes a layer: no g_idx and each K tile inside one group."""
    return (not has_g_idx and bits in (4, 8)
            and group_size % (block_kp * (32 // bits)) == 0)


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, bits: int, group_size: int, *, block_n: int,
               block_kp: int, split_k: int = 1, num_warps: int = 4,
               num_stages: int = 3) -> torch.Tensor:
    """``x @ W^T``: x ``[M, K]`` fp16/bf16/fp32 (rows contiguous), qweight int32
    ``[K*bits/32, N]``, scales/zeros ``[G, N]`` -> ``[M, N]`` in x's dtype. ``block_kp`` packed
    rows per K tile (``block_kp * 32/bits`` inputs, which must divide ``group_size``).

    Raises ValueError when the shapes disagree, the tile straddles groups, or the split-K
    counters would not fit (M * N / block_n > 65536)."""
    if bits not in (4, 8):
        raise ValueError(f"GEMV: bits={bits}; 4 and 8 are supported")
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"GEMV: x {x.dtype} {tuple(x.shape)} is not a 2-D fp16/bf16/fp32 "
                         f"tensor")
    m, k = x.shape
    n = qweight.shape[1]
    pf = 32 // bits
    if qweight.dtype != torch.int32 or qweight.shape[0] * pf != k:
        raise ValueError(f"qweight {qweight.dtype} {tuple(qweight.shape)} does not match K={k} "
                         f"at {bits} bits (int32 [K*bits/32, N])")
    if split_k < 1 or block_kp < 1 or block_n < 1 or (block_n & (block_n - 1)) or (
            block_kp & (block_kp - 1)):
        raise ValueError(f"GEMV: split_k={split_k} must be >= 1, block_n={block_n} and "
                         f"block_kp={block_kp} powers of two")
    if group_size <= 0 or not gemv_supported(bits, group_size, block_kp, False):
        raise ValueError(f"GEMV tile of {block_kp * pf} inputs does not divide group size "
                         f"{group_size} (bits={bits})")
    groups = -(-k // group_size)
    if (scales.dim() != 2 or scales.shape[0] < groups or scales.shape[1] != n
            or zeros.shape != scales.shape or zeros.stride() != scales.stride()
            or scales.stride(1) != 1 or qweight.stride(1) != 1):
        raise ValueError(f"GEMV: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} "
                         f"(strides {scales.stride()}, {zeros.stride()}) must be [>= {groups}, "
                         f"{n}] alike with unit column stride, qweight unit column stride")
    x, out, ws, cnt, n_tiles = launch_buffers(x, n, block_n, split_k, "GEMV")
    _wna16_gemv_kernel[(n_tiles, split_k, m)](
        x, qweight, scales, zeros, out, ws, cnt, m, n, k, group_size, x.stride(0),
        qweight.stride(0), scales.stride(0), out.stride(0), BITS=bits, SPLIT_K=split_k,
        BLOCK_N=block_n, BLOCK_KP=block_kp, num_warps=num_warps, num_stages=num_stages)
    return out
