"""SiLU-and-mul (SwiGLU's gate): out = silu(gate) * up, reading each input once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    pdl.wait(PDL)
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0)
    pdl.launch_dependents(PDL)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the input dtype
    tl.store(out_ptr + row * stride_o + offs,
             (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate then up), fp16/bf16/fp32 -> [num_tokens, d]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, d2 = x.shape
    d = d2 // 2
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(d, BLOCK))](x, out, d, x.stride(0), out.stride(0),
                                                         BLOCK=BLOCK, num_warps=4,
                                                         **pdl.launch_options(x.device))
    return out
