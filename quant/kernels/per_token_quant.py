"""Dynamic per-token (per-row) activation quantization to int8 or fp8 e4m3 in one launch.

One program per row walks K twice in ``BLOCK`` chunks: the row's absmax (fp32), then
``q = x / scale`` with ``scale = max(absmax, eps) / QMAX``; the second read of the row mostly
hits L2. It computes what the torch formulas of quant/int8.py (`quantize_per_token`) and
quant/fp8.py compute, bit for bit:

- the divisions are IEEE round-to-nearest (``tl.math.div_rn``, not the fast ``div.full.f32``);
- int8: ``torch.round`` (half to even) by adding and subtracting 1.5 * 2**23 in fp32, exact for
  |v| < 2**22 (here |v| <= 127 * (1 + 2**-23)) and the same in the interpreter and on the GPU,
  then clamp to [-127, 127];
- fp8: clamp to [-448, 448], then the round-to-nearest-even cast (``cvt.rn.satfinite`` on the
  GPU; under the interpreter, whose fp8 cast rounds wrongly, rounded in fp32 first).

Runs under ``TRITON_INTERPRET=1`` too (tests on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT8_EPS = 1e-8   # quant/int8.py quantize_per_token
FP8_EPS = 1e-12   # quant/fp8.py fp8_matmul
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_EPS = {torch.int8: INT8_EPS, torch.float8_e4m3fn: FP8_EPS}


@triton.jit
def _round_to_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded half to even to the nearest float8 e4m3 value, in fp32
    arithmetic: adding and subtracting 1.5 * 2**(23 + q), with 2**q the e4m3 spacing at |v|
    (2**-9 below 2**-6, the subnormals). Only for the interpreter, whose fp32 -> fp8 cast
    rounds ties up and drops the carry into the exponent; the GPU's cast rounds correctly."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    q = tl.maximum(e, -6) - 3
    magic = (((q + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (v + magic) - magic
    return tl.where(r == 0.0, v * 0.0, r)  # keep the sign of a zero, as the cast does


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, eps,
                            QMAX: tl.constexpr, IS_INT8: tl.constexpr, INTERPRET: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    poison = tl.zeros((BLOCK,), dtype=tl.float32)  # NaN where x has a NaN or an inf
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))  # (max ignores NaN: the poison carries it)
        poison += x * 0.0
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), eps), QMAX) + tl.sum(poison, axis=0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        ok = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale)
        if IS_INT8:
            v = (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: to an integer, half to even
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
        if not IS_INT8 and INTERPRET:
            v = _round_to_e4m3(v)
        tl.store(q_row + k0 + offs, v.to(q_ptr.dtype.element_ty), mask=ok)


def per_token_quant(x: torch.Tensor, out_dtype: torch.dtype, eps: float | None = None,
                    block: int | None = None, num_warps: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` symmetrically by its absmax.

    x: [T, K] float16 / bfloat16 / float32, unit stride along K (row stride free).
    out_dtype: ``torch.int8`` (QMAX 127, round half to even) or ``torch.float8_e4m3fn``
    (QMAX 448). eps: the floor of the absmax (default 1e-8 for int8, 1e-12 for fp8, as the
    torch formulas). Returns (xq [T, K] ``out_dtype`` contiguous, scale fp32 [T, 1]) with
    ``x ~= xq * scale``.
    Raises ValueError for another out_dtype or x dtype, a non-2-D x or a K stride other than 1.
    """
    if out_dtype not in _QMAX:
        raise ValueError(f"per_token_quant: out_dtype {out_dtype} is not torch.int8 or "
                         f"torch.float8_e4m3fn")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"per_token_quant: x dtype {x.dtype} is not float16/bfloat16/float32")
    if x.dim() != 2:
        raise ValueError(f"per_token_quant: x shape {tuple(x.shape)} is not [T, K]")
    t, k = x.shape
    if k > 1 and x.stride(1) != 1:
        raise ValueError(f"per_token_quant: x stride {x.stride()} is not unit along K")
    xq = torch.empty(t, k, dtype=out_dtype, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t == 0:
        return xq, scale
    if block is None:
        block = min(4096, max(16, triton.next_power_of_2(k)))
    if num_warps is None:
        num_warps = 8 if block >= 2048 else 4
    _per_token_quant_kernel[(t,)](
        x, xq, scale, k, x.stride(0), xq.stride(0),
        _EPS[out_dtype] if eps is None else eps,
        QMAX=_QMAX[out_dtype], IS_INT8=out_dtype == torch.int8, INTERPRET=not x.is_cuda,
        BLOCK=block,
        num_warps=num_warps)
    return xq, scale
