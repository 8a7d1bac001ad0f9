"""Round-to-nearest group quantization: the shared quantizer grid and the neutral form that the
calibrated methods (AWQ, GPTQ) and the checkpoint packers (``pagebatch.quant.packing``) share.

The grid is AutoGPTQ's ``Quantizer`` (min/max per group, widened to include 0): asymmetric
``scale = (max - min) / maxq``, ``zero = round(-min / scale)``; symmetric
``scale = 2 * absmax / maxq``, ``zero = 2^(bits-1)`` (always ±absmax, see `find_params`). A
weight is stored as ``w ≈ (q - zero) * scale`` with ``q`` in ``0..2^bits-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    """A linear weight in the neutral form the packers take.

    intweight: [out, in] int32 in 0..2^bits-1, columns in the layer's own order.
    zeros:     [out, n_groups] int32.
    scales:    [out, n_groups] float32.
    g_idx:     [in] int32 group of each input column (GPTQ act-order), or None for the
               sequential ``column // group_size``.
    group_size: as configured; -1 means one group over all ``in`` columns.
    """

    intweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    bits: int
    group_size: int

    def group_index(self) -> torch.Tensor:
        """[in] int64: the group of every input column."""
        n_in = self.intweight.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        gs = n_in if self.group_size == -1 else self.group_size
        return torch.arange(n_in, device=self.intweight.device) // gs

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: ``(intweight - zeros[g]) * scales[g]``."""
        g = self.group_index()
        return (self.intweight.float() - self.zeros.float()[:, g]) * self.scales[:, g]


def find_params(w: torch.Tensor, bits: int, sym: bool,
                min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row grid of ``w: [rows, cols]`` -> (scale [rows] float32, zero [rows] float32,
    integral). AutoGPTQ's ``Quantizer.find_params`` (perchannel, no MSE search).

    min_zero: the least zero point an asymmetric grid may use; AutoGPTQ's v1 checkpoints store
    ``zero - 1``, so they need 1. A row whose zero would be lower keeps its max and takes
    ``zero = min_zero`` with ``scale = max / (maxq - min_zero)``."""
    maxq = 2 ** bits - 1
    w = w.float()
    zero_t = torch.zeros(w.shape[0], device=w.device)
    xmin = torch.minimum(w.amin(dim=1), zero_t)
    xmax = torch.maximum(w.amax(dim=1), zero_t)
    if sym:
        # AutoGPTQ keeps xmin = 0 for a row with no negative value, which clips its top half
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    flat = (xmin == 0) & (xmax == 0)
    xmin = torch.where(flat, -torch.ones_like(xmin), xmin)
    xmax = torch.where(flat, torch.ones_like(xmax), xmax)
    scale = (xmax - xmin) / maxq
    if sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = torch.round(-xmin / scale)
        if min_zero:
            low = zero < min_zero
            scale = torch.where(low, xmax / (maxq - min_zero), scale)
            zero = torch.where(low, torch.full_like(zero, min_zero), zero)
    return scale, zero


def quantize_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     bits: int) -> torch.Tensor:
    """Integer codes of ``w: [rows, cols]`` on a per-row grid (scale, zero: [rows] or
    [rows, 1]) -> [rows, cols] float32 in 0..2^bits-1."""
    scale = scale.reshape(-1, 1)
    zero = zero.reshape(-1, 1)
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, 2 ** bits - 1)


@dataclass(frozen=True)
class QuantGrid:
    """The integer grid of a method: ``bits``, ``group_size`` input columns per group (-1: one
    group per row), symmetric (zero fixed at 2^(bits-1)) or asymmetric with zero points of at
    least ``min_zero``."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    min_zero: int = 0

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        return quantize_rtn(w, self.bits, self.group_size, self.sym, self.min_zero)

    def fake(self, w: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize ``w: [out, in]`` in its own dtype."""
        return fake_quantize(w, self.bits, self.group_size, self.sym, self.min_zero)


def _grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    out, n_in = w.shape
    gs = n_in if group_size == -1 else group_size
    if n_in % gs:
        raise ValueError(f"input size {n_in} is not a multiple of group size {group_size}")
    return w.reshape(out * (n_in // gs), gs), n_in // gs


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                 min_zero: int = 0) -> QuantizedWeight:
    """Round-to-nearest of ``w: [out, in]`` per group of ``group_size`` input columns (-1: one
    group). Raises ValueError when ``in`` is not a multiple of the group size."""
    out, n_in = w.shape
    flat, n_groups = _grouped(w.float(), group_size)
    scale, zero = find_params(flat, bits, sym, min_zero)
    q = quantize_to_grid(flat, scale, zero, bits)
    return QuantizedWeight(
        intweight=q.reshape(out, n_in).to(torch.int32),
        zeros=zero.reshape(out, n_groups).to(torch.int32),
        scales=scale.reshape(out, n_groups),
        g_idx=None, bits=bits, group_size=group_size)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                  min_zero: int = 0) -> torch.Tensor:
    """``quantize_rtn(w).dequantize()`` in ``w``'s dtype (what the layer computes with), without
    the integer round trip: the searches of AWQ call this many times per layer."""
    flat, _ = _grouped(w.float(), group_size)
    scale, zero = find_params(flat, bits, sym, min_zero)
    q = quantize_to_grid(flat, scale, zero, bits)
    return ((q - zero[:, None]) * scale[:, None]).reshape(w.shape).to(w.dtype)
