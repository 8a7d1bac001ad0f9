"""Decode-size W4A16 / W8A16 product on CUDA cores (no tensor cores): ``x @ W^T`` for a few rows
of x, over the canonical layout of quant/wna16.py (qweight int32 ``[K * bits / 32, N]`` packed
along K; scales, zeros ``[G, N]``), for layers whose group size is a multiple of the K tile.

At batch 1 the product is a matrix-vector one: the weight read is the whole cost, and the
instructions that turn each packed field into a float must keep up with it (an H200 SM issues
128 thread-instructions per cycle: at ~4 TB/s that leaves ~20 per 32-bit word of 8 fields).
Per 4-bit field the kernel does one AND/OR (a LOP3), one FMA and half a shift; the per-row
corrections and the group scale cost about one more per field:

- one shift of a word puts two fields at bits 15 and 19 (one 8-bit field at bit 15); a field at
  bit ``b`` is masked in place and ORed into the exponent ``150 - b`` of an fp32, which is then
  exactly ``2**(23 - b) + v`` (the "magic number" int-to-float conversion of FasterTransformer /
  AWQ, here in fp32). Mask and exponent are kernel arguments: as constants the compiler
  rematerialized them with a MOV before every LOP3;
- the FMA multiplies x by that float as it is; each row's sum (one word's fields) starts from
  minus the bases' share ``sum x * 2**(23 - b)`` and the zero point's ``z * sum x``, and the
  group's scale multiplies it once, so nothing large accumulates across K (activations with a
  non-zero mean stay exact to fp32 rounding: tests/test_wna16_gemv_edges.py);
- ``sub_tiles`` group-aligned K tiles are loaded per iteration and ``prefetch`` loads the next
  iteration's before this one is used (more bytes in flight); scales and zeros are loaded
  straight into the weight tile's register layout (a ``[BLOCK_N]`` load was moved there through
  shared memory and barriers every iteration); when K and N are multiples of the tile no loads
  are masked.

SASS per iteration (sm_90, 16 words per thread, Triton AOT on any machine:
scripts/sass_count.py): 757 instructions before these changes, 464 after; on the H200 the 8B
gate_up shape went 34.9 -> 26.9 us (docs/benchmarks.md, session 5). Split-K without extra
launches: core/kernels/splitk.py (the last-arriving program adds the partials).

``half2=True`` (4 bits; a tuned table's ``half2: 1``): the fields are dequantized and multiplied
in fp16 pairs instead (exllama / Marlin style, quant/kernels/wna16_half2.py): ~20 instructions
per word instead of ~29, at fp16 accumulation's precision (~5e-4 relative) and for ``|x| <=
65504``. ``half2`` defaults to False here; the H200 table takes it for every 8B shape at one row
(quant/kernels/wna16.py reads it for 16-bit activations only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagebatch.kernels import pdl
from pagebatch.kernels.splitk import gemv_columns, launch_buffers, splitk_store

from .wna16_half2 import group_constants, part_half2


@triton.jit
def _field(w, mask, expo):
    """The field ``w & mask`` (at bits ``b ..``) of each int32 in ``w`` as fp32 ``2**(23 - b) +
    v``: exact, the field is the low mantissa bits under the exponent ``expo`` (``150 - b``).
    ``mask`` and ``expo`` are kernel arguments, not constants: as constants the compiler
    rebuilds them in a register before every use (a MOV per field)."""
    return ((w & mask) | expo).to(tl.float32, bitcast=True)


@triton.jit
def _x_input(x_base, j, r_ok, EVEN: tl.constexpr):
    """Input ``j`` of each packed row (``x_base`` [SUB, BLOCK_KP] row starts) as fp32."""
    if EVEN:
        return tl.load(x_base + j).to(tl.float32)
    return tl.load(x_base + j, mask=r_ok, other=0.0).to(tl.float32)


@triton.jit
def _tile(q_ptr, s_ptr, z_ptr, kt, offs_s, offs_r, offs_n, n_ok, K, group_size, stride_qk,
          stride_sg, PF: tl.constexpr, BLOCK_KP: tl.constexpr, SUB: tl.constexpr,
          GROUP_SHIFT: tl.constexpr, EVEN: tl.constexpr, HALF2: tl.constexpr,
          USE_ASM: tl.constexpr):
    """Iteration ``kt``'s packed rows ``[SUB, BLOCK_KP]``, weight words ``[SUB, BLOCK_KP,
    BLOCK_N]`` and their scales and zeros (fp32, the words' shape). ``HALF2``: ``offs_r`` is
    the first half of each sub-tile's rows, the words are a pair (those rows, the second half's)
    and scales and zeros `group_constants` (quant/kernels/wna16_half2.py)."""
    BLOCK_K: tl.constexpr = BLOCK_KP * PF
    sub = kt * SUB + offs_s  # [SUB] sub-tile indices
    rows = sub[:, None] * BLOCK_KP + offs_r[None, :]  # [SUB, BLOCK_KP] packed rows
    if GROUP_SHIFT >= 0:  # group_size = BLOCK_K << GROUP_SHIFT
        g = sub >> GROUP_SHIFT
    else:
        g = (sub * BLOCK_K) // group_size
    q_ptrs = q_ptr + rows[:, :, None] * stride_qk + offs_n[None, None, :]
    # scales and zeros through pointers of the weight tile's shape (every row of a sub-tile the
    # same address): loaded straight into the layout they are used in, where a [SUB, BLOCK_N]
    # load would be moved there through shared memory and barriers each iteration
    sz_off = g[:, None, None] * stride_sg + offs_n[None, None, :] + 0 * rows[:, :, None]
    if EVEN:  # K a multiple of BLOCK_K * SUB, N of BLOCK_N: no masks
        q = tl.load(q_ptrs)
        s = tl.load(s_ptr + sz_off)
        z = tl.load(z_ptr + sz_off)
    else:
        qm = (rows * PF < K)[:, :, None] & n_ok[None, None, :]
        q = tl.load(q_ptrs, mask=qm, other=0)
        s = tl.load(s_ptr + sz_off, mask=qm, other=0.0)
        z = tl.load(z_ptr + sz_off, mask=qm, other=0.0)
    if HALF2:  # the second half's words (the same group): rows BLOCK_KP / 2 further on
        HALF: tl.constexpr = BLOCK_KP // 2
        if EVEN:
            q2 = tl.load(q_ptrs + HALF * stride_qk)
        else:
            qm2 = ((rows + HALF) * PF < K)[:, :, None] & n_ok[None, None, :]
            q2 = tl.load(q_ptrs + HALF * stride_qk, mask=qm2, other=0)
        s, z = group_constants(s, z, USE_ASM)
        return rows, (q, q2), s, z
    else:
        return rows, q, s.to(tl.float32), z.to(tl.float32)


@triton.jit
def _part_fp32(q, s, z, x_row, rows, K, mask_lo, mask_hi, expo_lo, expo_hi, BITS: tl.constexpr,
               SUB: tl.constexpr, BLOCK_KP: tl.constexpr, EVEN: tl.constexpr):
    """One iteration's fp32 partial sums ``[SUB, BLOCK_KP, BLOCK_N]`` (one per word) from the
    words ``q``, scales ``s`` and zeros ``z`` (fp32)."""
    PF: tl.constexpr = 32 // BITS
    # each shifted copy of a word puts PER fields at bits 15 (and 19): the top of the fp32
    # mantissa, where the float bases 2**(23 - off) are smallest (2**8, 2**4)
    PER: tl.constexpr = 2 if BITS == 4 else 1
    x_base = x_row + rows * PF
    r_ok = rows * PF < K
    # per row of the tile, before the products: the float bases' share (x_lo * 2**8 + x_hi *
    # 2**4, the fields put at bits 15 and 19) and the zero point's (z * sum x), so that each
    # row's sum starts from minus them and nothing large accumulates across tiles
    x_lo = tl.zeros((SUB, BLOCK_KP), dtype=tl.float32)
    x_hi = tl.zeros((SUB, BLOCK_KP), dtype=tl.float32)
    for j in tl.static_range(PF):
        xj = _x_input(x_base, j, r_ok, EVEN)
        if j % PER == 0:
            x_lo += xj
        else:
            x_hi += xj
    part = -(x_lo * (1 << 8) + x_hi * (1 << 4))[:, :, None] - (x_lo + x_hi)[:, :, None] * z
    for p in tl.static_range(PF // PER):
        # field p*PER moves from bit 8p to bit 15: a shift by 15 - 8p
        if p <= 1:
            w = q << (15 - 8 * p)
        else:
            w = q >> (8 * p - 15)
        for i in tl.static_range(PER):  # the same loads as above: the compiler reuses them
            xj = _x_input(x_base, p * PER + i, r_ok, EVEN)
            if i == 0:
                part += xj[:, :, None] * _field(w, mask_lo, expo_lo)
            else:
                part += xj[:, :, None] * _field(w, mask_hi, expo_hi)
    return part * s


@triton.jit(do_not_specialize=["M"])
def _wna16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
                       M, N, K, group_size, stride_xm, stride_qk, stride_sg, stride_om,
                       mask_lo, mask_hi, expo_lo, expo_hi,
                       BITS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_KP: tl.constexpr, SUB: tl.constexpr, GROUP_SHIFT: tl.constexpr,
                       EVEN: tl.constexpr, PREFETCH: tl.constexpr, GATED: tl.constexpr,
                       HALF2: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    PF: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KP * PF  # inputs of one sub-tile (inside one group)
    # HALF2: a sub-tile's rows r and r + BLOCK_KP / 2 are chained in fp16 (part_half2)
    ROWS: tl.constexpr = BLOCK_KP // 2 if HALF2 else BLOCK_KP
    offs_n, n_ok = gemv_columns(pid_n, N, BLOCK_N, GATED)  # weight columns
    offs_s = tl.arange(0, SUB)
    offs_r = tl.arange(0, ROWS)
    # one iteration loads SUB sub-tiles [SUB, BLOCK_KP, BLOCK_N] at once (more bytes in flight
    # per program than one group's tile allows); each sub-tile has its own group's scales
    k_tiles = tl.cdiv(K, BLOCK_K * SUB)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_start = pid_k * per_split
    kt_end = tl.minimum(kt_start + per_split, k_tiles)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros((SUB, ROWS, BLOCK_N), dtype=tl.float32)
    if PREFETCH:  # the next iteration's tile is loaded before this one is computed (clamped
        # into range: the last iteration loads its own tile again, from cache)
        rows_n, q_n, s_n, z_n = _tile(q_ptr, s_ptr, z_ptr, tl.minimum(kt_start, k_tiles - 1),
                                      offs_s, offs_r, offs_n, n_ok, K, group_size, stride_qk,
                                      stride_sg, PF, BLOCK_KP, SUB, GROUP_SHIFT, EVEN, HALF2,
                                      USE_ASM)
    # with PDL the first weight tile (prefetch) is read while the previous kernel finishes:
    # weights are written by no kernel; x is, so it is read only after the wait
    pdl.wait(PDL)
    for kt in range(kt_start, kt_end):
        if PREFETCH:
            rows, q, s, z = rows_n, q_n, s_n, z_n
            rows_n, q_n, s_n, z_n = _tile(q_ptr, s_ptr, z_ptr, tl.minimum(kt + 1, kt_end - 1),
                                          offs_s, offs_r, offs_n, n_ok, K, group_size,
                                          stride_qk, stride_sg, PF, BLOCK_KP, SUB, GROUP_SHIFT,
                                          EVEN, HALF2, USE_ASM)
        else:
            rows, q, s, z = _tile(q_ptr, s_ptr, z_ptr, kt, offs_s, offs_r, offs_n, n_ok, K,
                                  group_size, stride_qk, stride_sg, PF, BLOCK_KP, SUB,
                                  GROUP_SHIFT, EVEN, HALF2, USE_ASM)
        if HALF2:
            acc += part_half2(q, s, z, x_row, rows, K, BLOCK_KP, EVEN, USE_ASM)
        else:
            acc += _part_fp32(q, s, z, x_row, rows, K, mask_lo, mask_hi, expo_lo, expo_hi, BITS,
                              SUB, BLOCK_KP, EVEN)
    pdl.launch_dependents(PDL)
    res = tl.sum(tl.sum(acc, axis=1), axis=0)
    if HALF2:
        res = res * 256.0  # the weights entered the products as (v - z) / 256
    splitk_store(res, out_ptr + m * stride_om, ws_ptr, cnt_ptr, pid_k, m, M, N, n_ok, SPLIT_K,
                 BLOCK_N, GATED)


def gemv_supported(bits: int, group_size: int, block_kp: int, has_g_idx: bool) -> bool:
    """Whether the GEMV kernel takes a layer: no g_idx and each K tile inside one group."""
    return (not has_g_idx and bits in (4, 8)
            and group_size % (block_kp * (32 // bits)) == 0)


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, bits: int, group_size: int, *, block_n: int,
               block_kp: int, split_k: int = 1, sub_tiles: int = 1, prefetch: bool = False,
               gated: bool = False, half2: bool = False, num_warps: int = 4,
               num_stages: int = 3) -> torch.Tensor:
    """``x @ W^T``: x ``[M, K]`` fp16/bf16/fp32 (rows contiguous), qweight int32
    ``[K*bits/32, N]``, scales/zeros ``[G, N]`` -> ``[M, N]`` in x's dtype. ``block_kp`` packed
    rows per K sub-tile (``block_kp * 32/bits`` inputs, which must divide ``group_size``);
    ``sub_tiles`` consecutive sub-tiles (a power of two) are loaded per loop iteration;
    ``prefetch`` loads the next iteration's before this one's are used. ``gated``: W's columns
    are N/2 gate then N/2 up ones and the result is SiLU-and-mul of the product, ``[M, N/2]``
    (core/kernels/splitk.py). ``half2`` (4 bits, ``block_kp`` >= 2, sm_80+ on CUDA): the
    fields in fp16 pairs (quant/kernels/wna16_half2.py: integer zero points, ``|x| <=
    HALF2_X_MAX``, fp16 accumulation).

    Raises ValueError when the shapes disagree, the tile straddles groups, a gated N is odd,
    the split-K counters would not fit (M * N / block_n > 65536), or ``half2`` is asked at 8
    bits or ``block_kp`` 1."""
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
    if split_k < 1 or min(block_kp, block_n, sub_tiles) < 1 or any(
            v & (v - 1) for v in (block_n, block_kp, sub_tiles)):
        raise ValueError(f"GEMV: split_k={split_k} must be >= 1, block_n={block_n}, "
                         f"block_kp={block_kp} and sub_tiles={sub_tiles} powers of two")
    if group_size <= 0 or not gemv_supported(bits, group_size, block_kp, False):
        raise ValueError(f"GEMV tile of {block_kp * pf} inputs does not divide group size "
                         f"{group_size} (bits={bits})")
    if half2 and (bits != 4 or block_kp < 2):
        raise ValueError(f"GEMV: half2 needs bits=4 and block_kp >= 2 (bits={bits}, "
                         f"block_kp={block_kp})")
    groups = -(-k // group_size)
    if (scales.dim() != 2 or scales.shape[0] < groups or scales.shape[1] != n
            or zeros.shape != scales.shape or zeros.stride() != scales.stride()
            or scales.stride(1) != 1 or qweight.stride(1) != 1):
        raise ValueError(f"GEMV: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} "
                         f"(strides {scales.stride()}, {zeros.stride()}) must be [>= {groups}, "
                         f"{n}] alike with unit column stride, qweight unit column stride")
    if half2 and x.dtype != torch.float32 and (x.data_ptr() % 8 or x.stride(0) % 4):
        # 16-bit x is read four at a time (int64): a fresh copy is aligned
        x = x.clone(memory_format=torch.contiguous_format)
    b = launch_buffers(x, n, block_n, split_k, "GEMV", gated)
    block_k = block_kp * pf
    tiles_per_group = group_size // block_k
    shift = tiles_per_group.bit_length() - 1 if tiles_per_group & (tiles_per_group - 1) == 0 else -1
    lo, hi = 15, 15 + bits  # the two field positions after a word's shift (one at 8 bits)
    _wna16_gemv_kernel[(b.n_tiles, split_k, m)](
        b.x, qweight, scales, zeros, b.out, b.ws, b.cnt, m, b.n_out, k, group_size,
        b.x.stride(0), qweight.stride(0), scales.stride(0), b.out.stride(0),
        ((1 << bits) - 1) << lo, ((1 << bits) - 1) << hi, (150 - lo) << 23, (150 - hi) << 23,
        BITS=bits, SPLIT_K=split_k, BLOCK_N=block_n, BLOCK_KP=block_kp, SUB=sub_tiles,
        GROUP_SHIFT=shift, EVEN=k % (block_k * sub_tiles) == 0 and b.n_even,
        PREFETCH=bool(prefetch), GATED=bool(gated), HALF2=bool(half2), USE_ASM=x.is_cuda,
        num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_options(x.device))
    return b.out
