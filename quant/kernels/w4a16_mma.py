"""W4A16 product on tensor cores for decode sizes (and any M): ``x @ W^T`` computed as ``W @
x^T``, the 4-bit weights (canonical layout of quant/wna16.py, read as stored) as the MMA's A
operand (rows = outputs, ``BLOCK_N`` per program) and up to ``BLOCK_M`` rows of x as its B
operand: 2-16 rows cost about the weight read of one. Used where the tuned table
(quant/kernels/configs/wna16_<GPU>.json, ``kernel: mma``) measured it faster: on an H200, every
8B decode shape from 2 to 16 rows but the 16-row o projection (the 8B gate/up product at 8 rows:
43.5 us, against 117.0 us on the split-K GEMM of wna16.py). At one row the CUDA-core GEMV
(wna16_gemv.py) stays faster on every 8B shape (docs/benchmarks.md, session 8).

Dequantization is the "magic number" conversion of NVIDIA's FasterTransformer
(``fast_int4b_to_half``) and AWQ's kernels, in bf16, as inline PTX: a field ``v`` masked into
the low mantissa bits of the bf16 ``128.0`` (``0x4300``) is exactly ``128 + v``; one LOP3 makes
two of them (the fields at bits ``4s`` and ``16 + 4s`` of a word), a packed add of ``-(128 +
z)`` gives ``v - z`` exactly (integer zero points: AWQ and GPTQ's), and a packed multiply by the
group scale rounds ``(v - z) * s`` once, as the dequantized reference does. 3 shifts, 4 LOP3, 4
HADD2 and 4 HMUL2 per word of 8 weights; the MMA accumulates in fp32 across K (Triton splits
each K tile's wgmma so that it overlaps the next chunk's dequantization; with the scale applied
to the fp32 result instead, the wgmma had to finish every iteration: in a session-8 prototype
the 8B gate/up product at one row took 34.0 us against 26.4, docs/benchmarks.md). fp16
activations use the fp16 ``1024.0`` (``0x6400``) the same way.

Operand order: the 8 fields of a word come out of the assembly as 4 bf16 pairs, which the
kernel joins and permutes so that each thread's words are already its share of the A fragment
(no data moves between threads: checked in the SASS, scripts/sass_count.py --mma). The MMA's
input position ``P = 32 C + 16 c + 8 h + 2 t + p`` then holds field slot
``(2 c + h) + 4 p`` of word ``4 C + t`` of the tile, so x is read in that order (a gather of
BLOCK_K inputs per iteration).

Kernels run under ``TRITON_INTERPRET=1`` with the assembly replaced by the same arithmetic in
Triton operations (CI checks the operand order and the epilogues that way; the assembly itself
runs on a GPU only: tests/test_w4a16_mma.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagebatch.kernels import pdl
from pagebatch.kernels.splitk import gemv_columns, launch_buffers, splitk_store

RUN = 32  # inputs per run of the operand order (4 words)

_ASM_BODY = """
shr.u32 t0, $8, 4;
shr.u32 t1, $8, 8;
shr.u32 t2, $8, 12;
lop3.b32 w0, $8, 0x000F000F, MAGIC, 0xEA;
lop3.b32 w1, t0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 w2, t1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 w3, t2, 0x000F000F, MAGIC, 0xEA;
add.rn.TY w0, w0, c2;
add.rn.TY w1, w1, c2;
add.rn.TY w2, w2, c2;
add.rn.TY w3, w3, c2;
mul.rn.TY w0, w0, s2;
mul.rn.TY w1, w1, s2;
mul.rn.TY w2, w2, s2;
mul.rn.TY w3, w3, s2;
mov.b32 {$0, $1}, w0;
mov.b32 {$2, $3}, w1;
mov.b32 {$4, $5}, w2;
mov.b32 {$6, $7}, w3;
}"""
_ASM_HEAD = ("{\n.reg .b32 t0, t1, t2, c2, s2, w0, w1, w2, w3;\nmov.b32 c2, {$9, $9};\n"
             "mov.b32 s2, {$10, $10};")
# (a & b) | c is LOP3 lookup table 0xEA; 0x4300 = bf16 128.0, 0x6400 = fp16 1024.0
ASM_BF16 = tl.constexpr(_ASM_HEAD + _ASM_BODY.replace("MAGIC", "0x43004300")
                        .replace("TY", "bf16x2"))
ASM_F16 = tl.constexpr(_ASM_HEAD + _ASM_BODY.replace("MAGIC", "0x64006400")
                       .replace("TY", "f16x2"))


@triton.jit
def _field(q, shift, c, f, dtype):
    """The 4-bit field at ``shift`` of each word, as the assembly computes it: ``v - z``
    (exact) times the scale ``f``, rounded to ``dtype``."""
    return ((((q >> shift) & 15).to(tl.float32) + c).to(dtype).to(tl.float32) * f).to(dtype)


@triton.jit
def _operand(q, negc, sc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
             F16: tl.constexpr):
    """Words ``q`` int32 ``[BLOCK_N, BLOCK_K / 8]`` (rows = outputs, the tile's words along K),
    ``negc = -(base + z)`` and the scale ``sc`` per word (x's dtype) -> the weights ``(v - z) *
    s`` ``[BLOCK_N, BLOCK_K]`` in x's dtype, in the MMA's input order (module docstring)."""
    if USE_ASM:
        if F16:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [q, negc, sc],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [q, negc, sc],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:  # the same values without assembly (the interpreter, CPU tensors)
        c = negc.to(tl.float32) + (1024.0 if F16 else 128.0)
        f = sc.to(tl.float32)
        dt = negc.dtype
        v0 = _field(q, 0, c, f, dt)
        v1 = _field(q, 16, c, f, dt)
        v2 = _field(q, 4, c, f, dt)
        v3 = _field(q, 20, c, f, dt)
        v4 = _field(q, 8, c, f, dt)
        v5 = _field(q, 24, c, f, dt)
        v6 = _field(q, 12, c, f, dt)
        v7 = _field(q, 28, c, f, dt)
    # [BN, K/8, p, h, c] (tl.join adds a last dimension) -> [BN, run, c, h, t, p]
    w = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)),
                tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    w = tl.reshape(w, (BLOCK_N, BLOCK_K // 32, 4, 2, 2, 2))
    return tl.reshape(tl.permute(w, (0, 1, 5, 4, 2, 3)), (BLOCK_N, BLOCK_K))


@triton.jit(do_not_specialize=["M"])
def _w4a16_mma_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
                      M, N, K, group_size, stride_xm, stride_qk, stride_sg, stride_om,
                      SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr,
                      DECODE: tl.constexpr, USE_ASM: tl.constexpr, F16: tl.constexpr,
                      PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n, n_ok = gemv_columns(pid_n, N, BLOCK_N, GATED)  # weight rows (outputs)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    base = 1024.0 if F16 else 128.0
    q_rows = q_ptr + offs_w[None, :] * stride_qk + offs_n[:, None]
    # dot position P = 32 C + 16 c + 8 h + 2 t + p holds value i = 4 c + 2 h + p of word 4 C + t,
    # which is in field slot s = SLOT_OF[i] = (0, 4, 1, 5, 2, 6, 3, 7)[i]: input 8 (4 C + t) + s
    i = (offs_k // 16 % 2) * 4 + (offs_k // 8 % 2) * 2 + offs_k % 2
    slot = (i // 2) + (i % 2) * 4
    kperm = (offs_k // 32 * 4 + offs_k // 2 % 4) * 8 + slot
    x_cols = x_ptr + offs_m[None, :] * stride_xm + kperm[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    pdl.wait(PDL)
    for kt in range(kt0, kt1):
        g = (kt * BLOCK_K) // group_size
        if EVEN:
            q = tl.load(q_rows + kt * (BLOCK_K // 8) * stride_qk)
            z = tl.load(z_ptr + g * stride_sg + offs_n)
            s = tl.load(s_ptr + g * stride_sg + offs_n)
        else:
            q = tl.load(q_rows + kt * (BLOCK_K // 8) * stride_qk, mask=n_ok[:, None], other=0)
            z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0)
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0)
        xt = tl.load(x_cols + kt * BLOCK_K, mask=m_ok[None, :], other=0.0)  # [BK, BM]
        negc = (-base - z.to(tl.float32)).to(xt.dtype)
        w = _operand(q, tl.broadcast_to(negc[:, None], (BLOCK_N, BLOCK_K // 8)),
                     tl.broadcast_to(s[:, None], (BLOCK_N, BLOCK_K // 8)), BLOCK_N,
                     BLOCK_K, USE_ASM, F16)
        acc = tl.dot(w, xt, acc)
    pdl.launch_dependents(PDL)
    if DECODE:  # split-K through the workspace, one row of x at a time
        for mm in tl.static_range(BLOCK_M):
            if mm < M:
                res = tl.sum(tl.where(offs_m[None, :] == mm, acc, 0.0), axis=1)
                splitk_store(res, out_ptr + mm * stride_om, ws_ptr, cnt_ptr, pid_k, mm, M, N,
                             n_ok, SPLIT_K, BLOCK_N, GATED)
    else:
        out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def w4a16_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor, group_size: int, *, block_n: int = 128, block_k: int = 128,
              block_m: int = 16, split_k: int = 1, gated: bool = False, num_warps: int = 4,
              num_stages: int = 3) -> torch.Tensor:
    """``x @ W^T`` on tensor cores: x ``[M, K]`` bf16/fp16, qweight int32 ``[K / 8, N]`` (the
    canonical 4-bit layout), scales/zeros ``[G, N]`` (integer zeros in 0..15) -> ``[M, N]`` in
    x's dtype. ``block_k`` inputs per K tile (a multiple of 32 dividing ``group_size`` and K);
    ``block_m`` rows of x per MMA (>= 16). M <= ``block_m``: the decode path, ``split_k``
    programs per output tile (core/kernels/splitk.py) and optionally ``gated`` (W's N outputs
    are N/2 gate then N/2 up; returns SiLU-and-mul ``[M, N/2]``). Larger M: one program per
    (N, M) tile, no split.

    Raises ValueError when shapes or dtypes disagree, a tile straddles groups, or a gated or
    split product has more rows than ``block_m``."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"w4a16_mma: x {x.dtype} {tuple(x.shape)} is not a 2-D bf16/fp16 "
                         f"tensor")
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] * 8 != k or (
            qweight.stride(1) != 1):
        raise ValueError(f"w4a16_mma: qweight {qweight.dtype} {tuple(qweight.shape)} does not "
                         f"match K={k} (int32 [K/8, N], unit column stride)")
    if block_k % RUN or group_size % block_k or k % block_k:
        raise ValueError(f"w4a16_mma: block_k={block_k} must be a multiple of {RUN} dividing "
                         f"the group size {group_size} and K={k}")
    if block_m < 16 or block_n < 16 or any(v & (v - 1) for v in (block_m, block_n)):
        raise ValueError(f"w4a16_mma: block_m={block_m}, block_n={block_n} must be powers of "
                         f"two >= 16")
    if scales.shape != zeros.shape or scales.dim() != 2 or scales.shape[1] != n or (
            scales.shape[0] < k // group_size) or scales.stride() != zeros.stride() or (
            scales.stride(1) != 1):
        raise ValueError(f"w4a16_mma: scales {tuple(scales.shape)} / zeros "
                         f"{tuple(zeros.shape)} must be [>= {k // group_size}, {n}] alike with "
                         f"unit column stride")
    decode = m <= block_m
    if not decode and (gated or split_k > 1):
        raise ValueError(f"w4a16_mma: M={m} rows exceed block_m={block_m}: no split-K or "
                         f"gated epilogue")
    b = launch_buffers(x, n, block_n, split_k, "w4a16_mma", gated)
    grid = (b.n_tiles, split_k, 1 if decode else triton.cdiv(m, block_m))
    _w4a16_mma_kernel[grid](
        b.x, qweight, scales, zeros, b.out, b.ws, b.cnt, m, b.n_out, k, group_size,
        b.x.stride(0), qweight.stride(0), scales.stride(0), b.out.stride(0), SPLIT_K=split_k,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=block_m, EVEN=b.n_even, GATED=bool(gated),
        DECODE=decode, USE_ASM=x.is_cuda, F16=x.dtype == torch.float16,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(x.device))
    return b.out
