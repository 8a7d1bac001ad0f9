"""The fp16x2 inner loop of the batch-1 W4A16 GEMV (``wna16_gemv(..., half2=True)``,
quant/kernels/wna16_gemv.py): the 8 fields of a word are dequantized and multiplied with x as 4
fp16 pairs, exllama / Marlin style, instead of one fp32 FMA per field.

Per word ``w`` (canonical layout: field ``j`` at bits ``4j`` holds input ``8r + j``), as inline
PTX (1 shift, 4 LOP3 and 8 HFMA2 in the SASS):

- ``(w & 0x000F000F) | 0x64006400`` is the fp16 pair ``(1024 + v0, 1024 + v4)`` (the field is
  the low mantissa bits under fp16 1024: the "magic number" int-to-float conversion of
  FasterTransformer's ``fast_int4b_to_half``, exllama and Marlin); mask ``0x00F000F0`` gives
  ``(1024 + 16 v1, 1024 + 16 v5)``; ``w >> 8`` the same for fields 2, 6 and 3, 7;
- one HFMA2 each makes them ``(v - z) / 256`` exactly: ``a * 2**-8 - (4 + z/256)`` and ``a *
  2**-12 - (1/4 + z/256)`` (both constant pairs per group and column, from the zero point's
  low byte under fp16 -4: a PRMT, `_zero_pairs`);
- 4 HFMA2 with the input pairs ``(x_j, x_j+4)`` (fp16); two words of a column (rows r and r +
  BLOCK_KP/2 of a sub-tile, one group) are chained: 16 products per fp16 half, then the halves
  are added (HADD2), converted (one more HADD2) and the group scale multiplies the fp32 result
  (FFMA). The kernel multiplies its sums by 256 at the end (exact).

Range and precision. The weights enter as ``(v - z) / 256`` (the power-of-two scale sits in
the dequantizing HFMA2, free, where scaling x would cost an instruction per input) and x as
fp16, so ``|x| <= HALF2_X_MAX = 65504`` (the largest fp16; larger x is inf): each product is
then at most 65504 / 16 (``|v - z| <= 16``: zero points 0..16, GPTQ v1's ``stored + 1``
included), each half's 8 at most 32752 and the two halves' sum at most 65504, finite. Zero
points must be integers (AWQ, GPTQ: the PRMT takes their low byte). bf16 x in fp16's normal
range converts exactly, fp32 x rounds to fp16. Each HFMA2 rounds its running sum to fp16
(2**-11 relative): ~5e-4 relative error on the product against the fp32 path's ~1e-6, below
bf16's output rounding (~3e-3; tests/test_wna16_gemv_half2.py). Results below 2**-14 (fp16
subnormals) round to steps of 2**-24, 2**-16 in units of ``x (v - z)``: next to bf16's own
rounding of x (2**-9 of it) negligible while ``|x (v - z)| >> 2**-8``, i.e. for activations of
RMS above ~1e-2 (measured at RMS 1e-3: ~8e-4 relative error on the product, at 1e-4: ~7e-3).
The assembly needs sm_80+ (bf16x2 FMA, ``cvt.rn.f16x2.f32``).

SASS per iteration (sm_90, Triton 3.6, 16 words per thread, scripts/sass_count.py --half2):
the H200 table's 8B gate_up config (gated, 2 warps) 469 -> 320 instructions (29.3 -> 20.0 per
word), its down config (4 warps, 2 sub-tiles, prefetch) 521 -> 337 (32.6 -> 21.1); chaining one
word instead of two: 21.9 and 24.8. On the H200 (docs/benchmarks.md, "Session 9"; each shape's
best half2 config against the fp32 one of the table before): 8B qkv 8.6 -> 8.1 us, o 7.0 ->
6.6, gate_up (gated) 26.9 -> 21.1 (2.96 TB/s), down 15.5 -> 13.0, the 4-bit LM head 95.8 ->
80.9 (3.45 TB/s); batch-1 decode of the 8B shape with ``awq`` 394.4 -> 454.7 tok/s.

Under ``TRITON_INTERPRET=1`` (CPU tensors) ``USE_ASM`` is off and the same arithmetic runs in
Triton operations on the same fp16-pair bit patterns, each product rounded to fp16 as the HFMA2
rounds (through fp32: a double rounding where the assembly has one).
"""

from __future__ import annotations

import triton
import triton.language as tl

HALF2_X_MAX = 65504.0  # the largest |x| the fp16 products take (the largest fp16)

_WORD = """lop3.b32 a0, W, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a1, W, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 w8, W, 8;
lop3.b32 a2, w8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a3, w8, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 a0, a0, s8, $11;
fma.rn.f16x2 a1, a1, s12, $12;
fma.rn.f16x2 a2, a2, s8, $11;
fma.rn.f16x2 a3, a3, s12, $12;
"""
# $0 = the fp32 sum; $1, $6 the two words, $2..$5 and $7..$10 their input pairs, $11 and $12
# the zero point's pairs. (a & b) | c is LOP3 lookup table 0xEA; fp16 0x1C00 = 2**-8, 0x0C00 =
# 2**-12 (ptxas folds these constants into the HFMA2s)
ASM_CHAIN = tl.constexpr(
    "{\n.reg .b32 a0, a1, a2, a3, w8, p, s8, s12;\n.reg .b16 lo, hi;\n"
    "mov.b32 s8, 0x1C001C00;\nmov.b32 s12, 0x0C000C00;\n"
    + _WORD.replace("W", "$1") + "mul.rn.f16x2 p, a0, $2;\nfma.rn.f16x2 p, a1, $3, p;\n"
    "fma.rn.f16x2 p, a2, $4, p;\nfma.rn.f16x2 p, a3, $5, p;\n"
    + _WORD.replace("W", "$6") + "fma.rn.f16x2 p, a0, $7, p;\nfma.rn.f16x2 p, a1, $8, p;\n"
    "fma.rn.f16x2 p, a2, $9, p;\nfma.rn.f16x2 p, a3, $10, p;\n"
    "mov.b32 {lo, hi}, p;\nadd.rn.f16 lo, lo, hi;\ncvt.f32.f16 $0, lo;\n}")
# the zero points of two columns ($4: a bf16 / fp16 pair) -> per column -(4 + z/256) ($0, $1)
# and -(1/4 + z/256) ($2, $3) as fp16 pairs: z + 128 (bf16; fp16: + 1024) has z in its low
# byte, which PRMT puts twice under fp16 -4 (0xC4); then + 3.75 (0x4380)
_ZERO = """{
.reg .b32 t, k, one, base;
mov.b32 one, ONE;
mov.b32 base, BASE;
fma.rn.TY t, $4, one, base;
mov.b32 k, 0xC400C400;
prmt.b32 $0, t, k, 0x7050;
prmt.b32 $1, t, k, 0x7252;
mov.b32 k, 0x43804380;
add.rn.f16x2 $2, $0, k;
add.rn.f16x2 $3, $1, k;
}"""
ASM_ZERO_BF16 = tl.constexpr(_ZERO.replace("ONE", "0x3F803F80").replace("BASE", "0x43004300")
                             .replace("TY", "bf16x2"))
ASM_ZERO_F16 = tl.constexpr(_ZERO.replace("ONE", "0x3C003C00").replace("BASE", "0x64006400")
                            .replace("TY", "f16x2"))


@triton.jit
def _r16(v):
    """fp32 -> the nearest fp16, as fp32."""
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _lanes(p):
    """An fp16 pair's bits (int32) -> its halves (low, high) as fp32."""
    lo = p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16x2(lo, hi, USE_ASM: tl.constexpr):
    """fp32 ``lo``, ``hi`` -> the bits of the fp16 pair (int32, ``lo`` in bits 0..15), each
    rounded to nearest."""
    if USE_ASM:  # one instruction for both
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi],
                                         dtype=tl.int32, is_pure=True, pack=1)
    lo = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _x_pairs(x_row, rows, EVEN: tl.constexpr, K, USE_ASM: tl.constexpr):
    """Inputs ``(j, j + 4)`` of each packed row ``rows`` ``[SUB, R]`` of x's row ``x_row`` as
    fp16 pairs (int32 bits, input j in the low half), j = 0..3."""
    r_ok = rows * 8 < K
    if x_row.dtype.element_ty == tl.float32:
        xb = x_row + rows * 8
        if EVEN:
            x0, x1, x2, x3 = tl.load(xb), tl.load(xb + 1), tl.load(xb + 2), tl.load(xb + 3)
            x4, x5, x6, x7 = tl.load(xb + 4), tl.load(xb + 5), tl.load(xb + 6), tl.load(xb + 7)
        else:
            x0, x1 = tl.load(xb, mask=r_ok, other=0.0), tl.load(xb + 1, mask=r_ok, other=0.0)
            x2, x3 = tl.load(xb + 2, mask=r_ok, other=0.0), tl.load(xb + 3, mask=r_ok, other=0.0)
            x4, x5 = tl.load(xb + 4, mask=r_ok, other=0.0), tl.load(xb + 5, mask=r_ok, other=0.0)
            x6, x7 = tl.load(xb + 6, mask=r_ok, other=0.0), tl.load(xb + 7, mask=r_ok, other=0.0)
        return (_f16x2(x0, x4, USE_ASM), _f16x2(x1, x5, USE_ASM), _f16x2(x2, x6, USE_ASM),
                _f16x2(x3, x7, USE_ASM))
    # 16-bit x: the row's 8 inputs as 2 int64 (2 loads), 4 words of 2 (p0 = inputs 0 and 1, ..)
    xw = x_row.to(tl.pointer_type(tl.int64)) + rows * 2
    if EVEN:
        lo, hi = tl.load(xw), tl.load(xw + 1)
    else:
        lo, hi = tl.load(xw, mask=r_ok, other=0), tl.load(xw + 1, mask=r_ok, other=0)
    p0, p1 = lo.to(tl.int32), (lo >> 32).to(tl.int32)
    p2, p3 = hi.to(tl.int32), (hi >> 32).to(tl.int32)
    if x_row.dtype.element_ty == tl.bfloat16:  # a bf16 is the top half of an fp32
        return (_f16x2((p0 << 16).to(tl.float32, bitcast=True),
                       (p2 << 16).to(tl.float32, bitcast=True), USE_ASM),
                _f16x2((p0 & -65536).to(tl.float32, bitcast=True),
                       (p2 & -65536).to(tl.float32, bitcast=True), USE_ASM),
                _f16x2((p1 << 16).to(tl.float32, bitcast=True),
                       (p3 << 16).to(tl.float32, bitcast=True), USE_ASM),
                _f16x2((p1 & -65536).to(tl.float32, bitcast=True),
                       (p3 & -65536).to(tl.float32, bitcast=True), USE_ASM))
    # fp16: the halves regrouped (a PRMT each)
    return ((p0 & 0xFFFF) | (p2 << 16), ((p0 >> 16) & 0xFFFF) | (p2 & -65536),
            (p1 & 0xFFFF) | (p3 << 16), ((p1 >> 16) & 0xFFFF) | (p3 & -65536))


@triton.jit
def _zero_pairs(z, USE_ASM: tl.constexpr):
    """Zero points ``z`` (integers 0..127; bf16, fp16 or fp32) -> the fp16 pairs ``-(4 +
    z/256)`` and ``-(1/4 + z/256)`` (int32 bits), exact."""
    if z.dtype == tl.float32:
        z = z.to(tl.float16)
    if USE_ASM:
        if z.dtype == tl.bfloat16:
            return tl.inline_asm_elementwise(ASM_ZERO_BF16, "=r,=r,=r,=r,r", [z],
                                             dtype=(tl.int32, tl.int32), is_pure=True, pack=2)
        return tl.inline_asm_elementwise(ASM_ZERO_F16, "=r,=r,=r,=r,r", [z],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=2)
    base = 128.0 if z.dtype == tl.bfloat16 else 1024.0
    t = (z.to(tl.float32) + base).to(z.dtype).to(tl.int16, bitcast=True).to(tl.int32)
    c = (t & 0xFF) | 0xC400  # the PRMT
    lo, _ = _lanes(c)
    hi = _r16(lo + 3.75)
    return c | (c << 16), _f16x2(hi, hi, False)


@triton.jit
def group_constants(s, z, USE_ASM: tl.constexpr):
    """A tile's scales (-> fp32) and zero points (-> `_zero_pairs`), loaded in x's dtype in the
    words' shape. Converted when loaded: with prefetch the loop then carries 32-bit values (16-bit
    ones were repacked with PRMTs every iteration)."""
    if USE_ASM and s.dtype == tl.bfloat16:  # a bf16 pair is two fp32 less their low halves
        s = tl.inline_asm_elementwise("shl.b32 $0, $2, 16;\nand.b32 $1, $2, 0xFFFF0000;",
                                      "=r,=r,r", [s], dtype=tl.float32, is_pure=True, pack=2)
    return s.to(tl.float32), _zero_pairs(z, USE_ASM)


@triton.jit
def _field_ref(w, mask, scale, c, x, lo, hi):
    """One LOP3, its HFMA2 into ``(v - z) / 256`` and the HFMA2 with the input pair ``x``,
    rounded to fp16 as the assembly rounds (CPU)."""
    a_lo, a_hi = _lanes((w & mask) | 0x64006400)
    c_lo, c_hi = _lanes(c)
    x_lo, x_hi = _lanes(x)
    lo = _r16(_r16(a_lo * scale + c_lo) * x_lo + lo)
    return lo, _r16(_r16(a_hi * scale + c_hi) * x_hi + hi)


@triton.jit
def _word_ref(w, x0, x1, x2, x3, c_lo, c_hi, lo, hi):
    """The assembly's 4 LOP3 and 8 HFMA2 of one word (CPU)."""
    lo, hi = _field_ref(w, 0x000F000F, 2.0**-8, c_lo, x0, lo, hi)
    lo, hi = _field_ref(w, 0x00F000F0, 2.0**-12, c_hi, x1, lo, hi)
    lo, hi = _field_ref(w >> 8, 0x000F000F, 2.0**-8, c_lo, x2, lo, hi)
    return _field_ref(w >> 8, 0x00F000F0, 2.0**-12, c_hi, x3, lo, hi)


@triton.jit
def _chain(qa, xa0, xa1, xa2, xa3, qb, xb0, xb1, xb2, xb3, c_lo, c_hi, USE_ASM: tl.constexpr):
    """Two words of one group and column, their input pairs and the zero point's pairs ->
    ``sum x * (v - z) / 256`` of their 16 fields (fp32; fp16 running sums)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            ASM_CHAIN, "=f,r,r,r,r,r,r,r,r,r,r,r,r",
            [qa, xa0, xa1, xa2, xa3, qb, xb0, xb1, xb2, xb3, c_lo, c_hi], dtype=tl.float32,
            is_pure=True, pack=1)
    lo, hi = _word_ref(qa, xa0, xa1, xa2, xa3, c_lo, c_hi, tl.zeros(qa.shape, tl.float32),
                       tl.zeros(qa.shape, tl.float32))
    lo, hi = _word_ref(qb, xb0, xb1, xb2, xb3, c_lo, c_hi, lo, hi)
    return _r16(lo + hi)


@triton.jit
def _rows(xp, q):
    """Per-row values ``[SUB, R]`` broadcast to the words ``q`` ``[SUB, R, BLOCK_N]``."""
    return tl.broadcast_to(xp[:, :, None], q.shape)


@triton.jit
def part_half2(q, s, z, x_row, rows, K, BLOCK_KP: tl.constexpr, EVEN: tl.constexpr,
               USE_ASM: tl.constexpr):
    """One iteration's fp32 partial sums over 256, ``[SUB, BLOCK_KP / 2, BLOCK_N]``: each the
    chain of rows ``rows`` (``[SUB, BLOCK_KP / 2]``, the first half of each sub-tile) and
    ``rows + BLOCK_KP / 2`` of a column, times its group's scale. ``q``: the two halves' words
    (int32), ``s``, ``z``: `group_constants`; ``x_row``: x's row (bf16, fp16 or fp32)."""
    qa, qb = q
    c_lo, c_hi = z
    xa0, xa1, xa2, xa3 = _x_pairs(x_row, rows, EVEN, K, USE_ASM)
    xb0, xb1, xb2, xb3 = _x_pairs(x_row, rows + BLOCK_KP // 2, EVEN, K, USE_ASM)
    f = _chain(qa, _rows(xa0, qa), _rows(xa1, qa), _rows(xa2, qa), _rows(xa3, qa), qb,
               _rows(xb0, qa), _rows(xb1, qa), _rows(xb2, qa), _rows(xb3, qa), c_lo, c_hi,
               USE_ASM)
    return f * s
