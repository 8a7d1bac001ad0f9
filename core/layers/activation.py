"""SiLU-and-mul: the gated activation of Llama's MLP (SwiGLU, Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate then up) -> [num_tokens, d]. On CUDA one fused Triton
        kernel (core/kernels/activation.py)."""
        if x.is_cuda:
            from ..kernels.activation import silu_and_mul

            return silu_and_mul(x)
        return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """SiLU-and-mul in plain torch (the CPU path and the kernel's reference)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [.., I] buffer, not two
