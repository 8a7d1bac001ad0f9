"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), as AutoGPTQ's ``GPTQ.fasterquant`` runs it.

The layer-wise problem is ``argmin_Q ||W X - Q X||^2`` with ``H = 2 X X^T / n`` from the
calibration activations. Columns are quantized one at a time; each column's rounding error,
divided by the diagonal of the upper Cholesky factor of ``H^-1``, is fed back into the columns
not yet quantized (lazily, in blocks of 128 columns). Act-order (``desc_act``) visits columns in
order of decreasing ``diag(H)`` and records each column's group in ``g_idx``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .decoder import DecoderLayout, linear, run
from .rtn import QuantGrid, QuantizedWeight, find_params

logger = logging.getLogger(__name__)


@contextmanager
def _one_thread():
    """The solver is thousands of small ops on [out, <=128] slices: intra-op threads only add
    synchronisation (10x slower on a busy 2-core machine), so it runs on one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class GPTQ:
    """Hessian accumulator and solver for one linear layer with ``n_in`` input columns."""

    def __init__(self, n_in: int, device: torch.device | str = "cpu"):
        self.n_in = n_in
        self.H = torch.zeros(n_in, n_in, device=device, dtype=torch.float32)
        self.nsamples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """x: [..., n_in] inputs of the layer; every row is one token. Keeps
        ``H = 2/n sum x x^T`` as a running mean (AutoGPTQ counts batch rows as samples; here
        every token counts, which gives the same H up to a constant factor)."""
        x = x.reshape(-1, self.n_in).float()
        n = x.shape[0]
        self.H *= self.nsamples / (self.nsamples + n)
        self.nsamples += n
        x = x * (2.0 / self.nsamples) ** 0.5
        self.H.addmm_(x.t(), x)

    def _hinv_upper(self, H: torch.Tensor, damp: float) -> torch.Tensor:
        """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1; damping grows 10x (up to 3
        times) when H is not positive definite."""
        diag = torch.arange(self.n_in, device=H.device)
        mean_diag = torch.mean(torch.diag(H))
        for _ in range(4):
            Hd = H.clone()
            Hd[diag, diag] += damp * mean_diag
            L, info = torch.linalg.cholesky_ex(Hd)
            if info == 0:
                Hinv = torch.cholesky_inverse(L)
                U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
                if info == 0:
                    return U
            logger.warning("GPTQ: Hessian not positive definite at damp %.3g, retrying", damp)
            damp *= 10
        raise ValueError("GPTQ: Hessian stays singular after damping; more calibration data?")

    @torch.no_grad()
    def quantize(self, w: torch.Tensor, grid: QuantGrid, act_order: bool = False,
                 damp: float = 0.01, blocksize: int = 128) -> QuantizedWeight:
        """Quantize ``w: [out, n_in]`` against the accumulated Hessian.

        Groups are runs of ``grid.group_size`` columns (-1: one group) in quantization order;
        with act_order that order is by decreasing diag(H) and ``g_idx`` maps each original
        column to its group. A group's grid comes from its error-updated weights when the
        solver reaches it. Raises ValueError when n_in is not a multiple of the group size.
        """
        if self.nsamples == 0:
            raise ValueError("GPTQ: no calibration inputs were added")
        n_in = w.shape[1]
        gs = n_in if grid.group_size == -1 else grid.group_size
        if n_in % gs:
            raise ValueError(f"input size {n_in} is not a multiple of group size "
                             f"{grid.group_size}")
        W = w.detach().float().clone()
        H = self.H.clone()
        dead = torch.diag(H) == 0
        H[dead, dead] = 1
        W[:, dead] = 0

        with _one_thread():
            return self._solve(W, H, grid, gs, act_order, damp, blocksize)

    def _solve(self, W: torch.Tensor, H: torch.Tensor, grid: QuantGrid, gs: int,
               act_order: bool, damp: float, blocksize: int) -> QuantizedWeight:
        n_in = W.shape[1]
        maxq = 2 ** grid.bits - 1
        perm = None
        if act_order:
            perm = torch.argsort(torch.diag(H), descending=True, stable=True)
            W = W[:, perm]
            H = H[perm][:, perm]
        Hinv = self._hinv_upper(H, damp)

        Q = torch.zeros_like(W, dtype=torch.int32)
        scales, zeros = [], []
        scale = zero = None
        for i1 in range(0, n_in, blocksize):
            i2 = min(i1 + blocksize, n_in)
            W1 = W[:, i1:i2].clone()
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if col % gs == 0:  # a new group: its grid from the error-updated weights
                    g = W1[:, i:i + gs]
                    if col + gs > i2:
                        g = torch.cat([g, W[:, i2:col + gs]], dim=1)
                    scale, zero = find_params(g, grid.bits, grid.sym, grid.min_zero)
                    scales.append(scale)
                    zeros.append(zero)
                wcol = W1[:, i]
                q = torch.clamp(torch.round(wcol / scale) + zero, 0, maxq)
                Q[:, col] = q.to(torch.int32)
                err = (wcol - (q - zero) * scale) / Hinv1[i, i]
                W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
                Err1[:, i] = err
            W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

        g_idx = None
        if perm is not None:
            invperm = torch.argsort(perm)
            Q = Q[:, invperm]
            g_idx = (invperm // gs).to(torch.int32)
        return QuantizedWeight(intweight=Q, zeros=torch.stack(zeros, 1).to(torch.int32),
                               scales=torch.stack(scales, 1), g_idx=g_idx, bits=grid.bits,
                               group_size=grid.group_size)


@torch.no_grad()
def gptq_layer(layer: nn.Module, layout: DecoderLayout, x: torch.Tensor,
               kwargs: dict[str, Any], grid: QuantGrid, act_order: bool = False,
               damp: float = 0.01) -> dict[str, QuantizedWeight]:
    """GPTQ one decoder layer in place, AutoGPTQ's "true sequential" way: for each group of
    linears in ``layout.sequential`` (k, v, q; o; up, gate; down) the Hessians come from a
    forward over ``x: [n_samples, seq_len, hidden]`` with the groups before already quantized.
    Weights are replaced by their dequantized values; returns the neutral form by name."""
    result = {}
    for group in layout.sequential:
        solvers = {n: GPTQ(linear(layer, n).in_features, linear(layer, n).weight.device)
                   for n in group}
        handles = [linear(layer, n).register_forward_hook(
            lambda m, inp, out, n=n: solvers[n].add_batch(inp[0])) for n in group]
        try:
            run(layer, x, kwargs)
        finally:
            for h in handles:
                h.remove()
        for n in group:
            lin = linear(layer, n)
            qw = solvers.pop(n).quantize(lin.weight, grid, act_order=act_order, damp=damp)
            lin.weight.data = qw.dequantize().to(lin.weight.dtype)
            result[n] = qw
    return result
