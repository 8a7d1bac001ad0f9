"""Rotary embedding (RoPE, rotate-half / GPT-NeoX layout) of q and k in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _rotate_heads(x_ptr, out_ptr, t, stride_t, stride_h, stride_ot, cos, sin, num_heads,
                  HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    src = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + t * stride_ot + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])  # a view of the step buffer
def _rotary_kernel(pos_ptr, cos_sin_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr,
                   num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_qot, stride_kot, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    pos = tl.load(pos_ptr + t)
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs_d, mask=d_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs_d, mask=d_ok, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, stride_qot, cos, sin, num_q_heads,
                  HALF, QH_PAD, HALF_PAD)
    _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, stride_kot, cos, sin, num_k_heads,
                  HALF, KH_PAD, HALF_PAD)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int64; q: [T, Hq, D], k: [T, Hkv, D] (any strides with a contiguous last
    dim); cos_sin: [max_position, D] fp32, cos then sin halves. Returns new rotated (q, k),
    contiguous, in their dtypes."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t:
        half = d // 2
        _rotary_kernel[(t,)](
            positions, cos_sin, q, k, q_out, k_out, hq, hk, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), q_out.stride(0), k_out.stride(0), HALF=half,
            HALF_PAD=triton.next_power_of_2(half), QH_PAD=triton.next_power_of_2(hq),
            KH_PAD=triton.next_power_of_2(hk), num_warps=4, **pdl.launch_options(q.device))
    return q_out, k_out
