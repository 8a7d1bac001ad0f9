"""RMSNorm with the residual add fused in: one pass over x (and residual) per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    pdl.wait(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    pdl.launch_dependents(PDL)
    if HAS_RESIDUAL:
        x = add_residual(x, res_ptr + row * stride_r, res_out_ptr + row * stride_ro, offs, mask)
    tl.store(out_ptr + row * stride_o + offs,
             rms_norm_row(x, w_ptr, offs, mask, n_cols, eps, out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def add_residual(x, res_ptr, res_out_ptr, offs, mask):
    """``x + residual`` of a row, rounded to x's dtype as torch's ``x + r`` is, and stored as
    the new residual."""
    r = tl.load(res_ptr + offs, mask=mask, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(res_out_ptr + offs, x, mask=mask)
    return x


@triton.jit
def rms_norm_row(x, w_ptr, offs, mask, n_cols, eps, out_dtype):
    """RMSNorm of one row ``x`` [BLOCK] (masked lanes 0) times the weight, in ``out_dtype``:
    computed in fp32 in Hugging Face's order (normalise, cast to x's dtype, then scale)."""
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    return (w.to(tl.float32) * y.to(tl.float32)).to(out_dtype)


def row_warps(block: int) -> int:
    """Warps for a kernel with one program per row of ``block`` (power of two) elements."""
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x (and residual): [..., hidden] fp16/bf16/fp32; weight: [hidden] in x's dtype.
    Returns norm(x) * weight, or with ``residual`` (norm(x + residual) * weight, x + residual),
    new tensors of x's shape and dtype."""
    shape = x.shape
    x2 = _rows(x)
    n_rows, n = x2.shape
    out = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    warps = row_warps(block)
    if residual is None:
        if n_rows:
            _rms_norm_kernel[(n_rows,)](x2, x2, weight, out, out, n, eps, x2.stride(0), 0,
                                        out.stride(0), 0, HAS_RESIDUAL=False, BLOCK=block,
                                        num_warps=warps, **pdl.launch_options(x.device))
        return out.view(shape)
    r2 = _rows(residual)
    res_out = torch.empty_like(out)
    if n_rows:
        _rms_norm_kernel[(n_rows,)](x2, r2, weight, out, res_out, n, eps, x2.stride(0),
                                    r2.stride(0), out.stride(0), res_out.stride(0),
                                    HAS_RESIDUAL=True, BLOCK=block, num_warps=warps,
                                    **pdl.launch_options(x.device))
    return out.view(shape), res_out.view(shape)


@triton.jit
def _qk_head_norm_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, eps, stride_qt, stride_qh, stride_kt,
                         stride_kh, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HEAD_DIM
    if h < NUM_Q_HEADS:
        ptr = q_ptr + t * stride_qt + h * stride_qh
        w_ptr = qw_ptr
    else:
        ptr = k_ptr + t * stride_kt + (h - NUM_Q_HEADS) * stride_kh
        w_ptr = kw_ptr
    pdl.wait(PDL)
    x = tl.load(ptr + offs, mask=mask, other=0.0)
    pdl.launch_dependents(PDL)
    tl.store(ptr + offs, rms_norm_row(x, w_ptr, offs, mask, HEAD_DIM, eps, x.dtype), mask=mask)


def qk_head_norm_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k in place, in one launch (Qwen3's ``q_norm`` / ``k_norm``,
    before rotary): q [T, Hq, D], k [T, Hkv, D] fp16/bf16/fp32, each with unit stride in D (the
    strided views of a fused QKV projection's output are fine: no copy); weights [D] in their
    dtype. Each head vector becomes ``norm(x) * weight`` as in `rms_norm` (fp32 inside,
    Hugging Face's order). Returns (q, k)."""
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"qk_head_norm_: q {tuple(q.shape)} and k {tuple(k.shape)} need the "
                         f"same tokens and head size, and unit stride in the head dimension "
                         f"(strides {q.stride()}, {k.stride()})")
    if t:
        _qk_head_norm_kernel[(t, hq + k.shape[1])](
            q, k, q_weight, k_weight, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            NUM_Q_HEADS=hq, HEAD_DIM=d, BLOCK=triton.next_power_of_2(d), num_warps=1,
            **pdl.launch_options(q.device))
    return q, k
