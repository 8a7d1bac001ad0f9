"""RMSNorm (Zhang & Sennrich, 2019), with the residual add fused in the same call."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``tp``: under tensor parallelism, the context whose ranks' partial sums ``x`` is when a
    residual is given (the row-parallel layer before it built with ``reduce_results=False``):
    the all-reduce then happens here, fused with the residual add and the norm where
    `ParallelContext.all_reduce_rms_norm` can (the one-shot kernel), else as an all-reduce
    followed by the norm. Without a residual (the first layer's input), x is whole."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 tp=None):
        super().__init__()
        self.eps = eps
        self.tp = tp if tp is not None and tp.tp_size > 1 else None
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [num_tokens, hidden]. With ``residual``, returns (norm(x + residual), x + residual);
        without, returns norm(x). Computed in fp32, returned in x's dtype. On CUDA one fused
        Triton kernel (core/kernels/norm.py) does it."""
        if self.tp is not None and residual is not None:
            fused = self.tp.all_reduce_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = self.tp.tp_all_reduce(x)
        if x.is_cuda:
            from ..kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_torch(x, self.weight, self.eps, residual)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """RMSNorm in plain torch (the CPU path and the kernels' reference); see RMSNorm.forward."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)  # the order of Hugging Face's LlamaRMSNorm
    return out if residual is None else (out, residual)
