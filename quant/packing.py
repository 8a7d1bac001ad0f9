"""Packing and unpacking of the public 4/8-bit checkpoint layouts (AutoAWQ GEMM, AutoGPTQ /
GPTQModel), and per-channel int8 / fp8 weight quantization.

Every function here works on plain integer tensors in one convention, which the quantizer
(quant/calibrate/) produces and the quant methods (quant/awq.py, quant/gptq.py) consume::

    w[o, i] ~= (intweight[o, i] - zeros[o, g(i)]) * scales[o, g(i)]

with ``intweight`` in ``0 .. 2**bits - 1``, ``g(i) = i // group_size`` (``group_size == -1``:
one group over the whole input) or ``g(i) = g_idx[i]`` for GPTQ act-order checkpoints.

Layouts (``out`` = output features, ``in`` = input features, ``G`` = number of groups):

- AutoAWQ "GEMM" (awq/modules/linear/gemm.py ``WQLinear_GEMM.from_linear``, 4 bits only):
  ``qweight`` int32 ``[in, out/8]`` packed along the output dimension, nibble ``j`` (bits
  ``4j..4j+3``) of word ``c`` holding output ``8c + AWQ_ORDER[j]`` with AWQ_ORDER =
  [0, 2, 4, 6, 1, 3, 5, 7]; ``qzeros`` int32 ``[G, out/8]`` in the same order; ``scales``
  ``[G, out]`` (fp16 in AutoAWQ's files).
- AutoGPTQ / GPTQModel (auto_gptq/nn_modules/qlinear/qlinear_cuda.py ``QuantLinear.pack``):
  ``qweight`` int32 ``[in*bits/32, out]`` packed along the input dimension, field ``j`` of row
  ``r`` holding input ``r*32/bits + j`` (sequential order); ``qzeros`` int32 ``[G, out*bits/32]``
  packed along the output dimension, sequential; ``scales`` ``[G, out]``; ``g_idx`` int32
  ``[in]``. ``checkpoint_format="gptq"`` (v1) stores each zero point minus one (AutoGPTQ's
  historical convention, so a zero point of 0 cannot be stored); ``"gptq_v2"`` (GPTQModel)
  stores it as is.
"""

from __future__ import annotations

import torch
from torch import Tensor

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble j of a word holds output column AWQ_ORDER[j]
GPTQ_FORMATS = ("gptq", "gptq_v2")


# ---- bit fields ---------------------------------------------------------------------------------

def _to_int32(words: Tensor) -> Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_fields(values: Tensor, bits: int, dim: int) -> Tensor:
    """Pack ``32 // bits`` consecutive entries of ``values`` along ``dim`` into one int32, the
    first in the lowest bits. values: int, each in ``0 .. 2**bits - 1``; ``values.shape[dim]``
    a multiple of ``32 // bits``. Returns int32 with ``shape[dim]`` divided by ``32 // bits``."""
    pf = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % pf:
        raise ValueError(f"dimension {dim} of size {v.shape[-1]} is not a multiple of {pf}")
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 2**bits):
        raise ValueError(f"values outside 0..{2**bits - 1} cannot be packed in {bits} bits")
    v = v.reshape(*v.shape[:-1], -1, pf)
    shifts = torch.arange(0, 32, bits, device=v.device, dtype=torch.int64)
    return _to_int32((v << shifts).sum(-1)).movedim(-1, dim).contiguous()


def unpack_fields(words: Tensor, bits: int, dim: int) -> Tensor:
    """Inverse of `pack_fields`: int32 words -> int32 values ``0 .. 2**bits - 1`` with
    ``shape[dim]`` multiplied by ``32 // bits``."""
    w = words.movedim(dim, -1).to(torch.int32)
    shifts = torch.arange(0, 32, bits, device=w.device, dtype=torch.int32)
    v = (w[..., None] >> shifts) & (2**bits - 1)  # arithmetic shift: the mask drops the sign
    return v.reshape(*w.shape[:-1], -1).movedim(-1, dim).contiguous()


def num_groups(in_features: int, group_size: int) -> int:
    """Number of quantization groups along the input; raises ValueError when ``group_size``
    (-1 = one group) does not divide ``in_features``."""
    if group_size == -1:
        return 1
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={in_features}")
    return in_features // group_size


def default_g_idx(in_features: int, group_size: int, device=None) -> Tensor:
    """``[in]`` int32: input channel -> group, ``i // group_size`` (all 0 for group -1)."""
    gs = in_features if group_size == -1 else group_size
    return torch.arange(in_features, device=device, dtype=torch.int32) // gs


def _check_convention(intweight: Tensor, zeros: Tensor, scales: Tensor, n_groups: int) -> None:
    out = intweight.shape[0]
    if tuple(zeros.shape) != (out, n_groups) or tuple(scales.shape) != (out, n_groups):
        raise ValueError(f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} must be "
                         f"[out={out}, n_groups={n_groups}]")


# ---- AutoAWQ GEMM -------------------------------------------------------------------------------

def pack_awq(intweight: Tensor, zeros: Tensor, scales: Tensor,
             group_size: int) -> dict[str, Tensor]:
    """Pack into the AutoAWQ GEMM layout (4 bits).

    intweight: [out, in] int, 0..15; zeros: [out, n_groups] int, 0..15; scales: [out, n_groups]
    float; group_size: 32, 64, 128, ... or -1 (one group). ``out`` must be a multiple of 8.
    Returns {"qweight": int32 [in, out/8], "qzeros": int32 [n_groups, out/8],
    "scales": [n_groups, out] in ``scales``' dtype (AutoAWQ writes fp16)}.
    Raises ValueError on shapes or values out of range.
    """
    n_groups = num_groups(intweight.shape[1], group_size)
    _check_convention(intweight, zeros, scales, n_groups)
    order = torch.tensor(AWQ_ORDER, device=intweight.device)

    def pack_out(t: Tensor) -> Tensor:  # [rows, out] -> [rows, out/8], AWQ nibble order
        if t.shape[1] % 8:
            raise ValueError(f"out={t.shape[1]} is not a multiple of 8")
        t = t.reshape(t.shape[0], -1, 8).index_select(2, order).reshape(t.shape[0], -1)
        return pack_fields(t, 4, dim=1)

    return {"qweight": pack_out(intweight.t()), "qzeros": pack_out(zeros.t()),
            "scales": scales.t().contiguous()}


def unpack_awq(qweight: Tensor, qzeros: Tensor | None, scales: Tensor,
               group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `pack_awq`.

    qweight: int32 [in, out/8]; qzeros: int32 [n_groups, out/8], or None for a checkpoint
    without zero points (``zero_point: false``: unsigned nibbles with an implied zero of 8, the
    ``uint4b8`` type vLLM's AWQ-Marlin path uses); scales: [n_groups, out].
    Returns (intweight int32 [out, in], zeros int32 [out, n_groups], scales [out, n_groups]).
    """
    inv = torch.argsort(torch.tensor(AWQ_ORDER, device=qweight.device))

    def unpack_out(t: Tensor) -> Tensor:  # [rows, out/8] -> [rows, out], natural order
        v = unpack_fields(t, 4, dim=1)
        return v.reshape(v.shape[0], -1, 8).index_select(2, inv).reshape(v.shape[0], -1)

    intweight = unpack_out(qweight).t().contiguous()
    n_groups = num_groups(intweight.shape[1], group_size)
    if tuple(scales.shape) != (n_groups, intweight.shape[0]):
        raise ValueError(f"scales {tuple(scales.shape)} must be [n_groups={n_groups}, "
                         f"out={intweight.shape[0]}]")
    if qzeros is None:
        zeros = torch.full((intweight.shape[0], n_groups), 8, dtype=torch.int32,
                           device=qweight.device)
    else:
        zeros = unpack_out(qzeros).t().contiguous()
    return intweight, zeros, scales.t().contiguous()


def dequantize_awq(qweight: Tensor, qzeros: Tensor | None, scales: Tensor,
                   group_size: int) -> Tensor:
    """AutoAWQ GEMM tensors (see `unpack_awq`) -> weight [out, in] in ``scales``' dtype."""
    intweight, zeros, s = unpack_awq(qweight, qzeros, scales, group_size)
    return dequantize(intweight, zeros, s, default_g_idx(intweight.shape[1], group_size,
                                                         intweight.device))


# ---- AutoGPTQ / GPTQModel -----------------------------------------------------------------------

def pack_gptq(intweight: Tensor, zeros: Tensor, scales: Tensor, g_idx: Tensor | None, bits: int,
              group_size: int, checkpoint_format: str = "gptq") -> dict[str, Tensor]:
    """Pack into the AutoGPTQ / GPTQModel layout.

    intweight: [out, in] int, 0..2**bits-1; zeros: [out, n_groups] int, same range;
    scales: [out, n_groups] float; g_idx: [in] int32 group of each input channel (act-order
    checkpoints), None for ``i // group_size``; bits: 4 or 8; group_size: a divisor of ``in``
    or -1; checkpoint_format: "gptq" (v1, stores zero - 1) or "gptq_v2" (stores zero).
    ``in`` and ``out`` must be multiples of ``32 // bits``.
    Returns {"qweight": int32 [in*bits/32, out], "qzeros": int32 [n_groups, out*bits/32],
    "scales": [n_groups, out] in ``scales``' dtype, "g_idx": int32 [in]}.
    Raises ValueError on bad shapes or values, and for a zero point of 0 in the v1 format
    (it would be stored as -1, which AutoGPTQ's packer spills into the neighbouring fields).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported (4 or 8)")
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r} is not one of {GPTQ_FORMATS}")
    in_features = intweight.shape[1]
    n_groups = num_groups(in_features, group_size)
    if g_idx is None:
        g_idx = default_g_idx(in_features, group_size, intweight.device)
    n_groups = max(n_groups, int(g_idx.max()) + 1) if g_idx.numel() else n_groups
    _check_convention(intweight, zeros, scales, n_groups)
    stored = zeros.to(torch.int64)
    if checkpoint_format == "gptq":
        if stored.numel() and int(stored.min()) < 1:
            raise ValueError("a zero point of 0 cannot be stored in checkpoint_format 'gptq' "
                             "(v1 stores zero - 1); use 'gptq_v2'")
        stored = stored - 1
    return {"qweight": pack_fields(intweight, bits, dim=1).t().contiguous(),
            "qzeros": pack_fields(stored.t(), bits, dim=1),
            "scales": scales.t().contiguous(),
            "g_idx": g_idx.to(torch.int32).contiguous()}


def unpack_gptq(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor | None, bits: int,
                group_size: int, checkpoint_format: str = "gptq"
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Inverse of `pack_gptq`.

    qweight: int32 [in*bits/32, out]; qzeros: int32 [n_groups, out*bits/32]; scales:
    [n_groups, out]; g_idx: int32 [in] or None (``i // group_size``).
    Returns (intweight int32 [out, in], zeros int32 [out, n_groups], scales [out, n_groups],
    g_idx int32 [in]). In the v1 format the zero point is the stored field plus one, without
    wrap-around (AutoGPTQ's torch path: ``(qzeros >> shift) & mask`` then ``+ 1``).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported (4 or 8)")
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r} is not one of {GPTQ_FORMATS}")
    intweight = unpack_fields(qweight, bits, dim=0).t().contiguous()
    in_features, out = intweight.shape[1], intweight.shape[0]
    if g_idx is None:
        g_idx = default_g_idx(in_features, group_size, qweight.device)
    zeros = unpack_fields(qzeros, bits, dim=1)[:, :out]
    if checkpoint_format == "gptq":
        zeros = zeros + 1  # AutoGPTQ's torch path: zeros = zeros + 1 after the bit mask
    if tuple(scales.shape) != (zeros.shape[0], out):
        raise ValueError(f"scales {tuple(scales.shape)} must be [n_groups={zeros.shape[0]}, "
                         f"out={out}]")
    return intweight, zeros.t().contiguous(), scales.t().contiguous(), g_idx.to(torch.int32)


def dequantize_gptq(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor | None,
                    bits: int, group_size: int, checkpoint_format: str = "gptq") -> Tensor:
    """AutoGPTQ / GPTQModel tensors (see `unpack_gptq`) -> weight [out, in] in ``scales``'
    dtype."""
    intweight, zeros, s, gi = unpack_gptq(qweight, qzeros, scales, g_idx, bits, group_size,
                                          checkpoint_format)
    return dequantize(intweight, zeros, s, gi)


def dequantize(intweight: Tensor, zeros: Tensor, scales: Tensor, g_idx: Tensor) -> Tensor:
    """The convention itself: intweight [out, in] int, zeros/scales [out, n_groups], g_idx [in]
    int -> ``(intweight - zeros[:, g_idx]) * scales[:, g_idx]``, [out, in] in ``scales``'
    dtype (computed in fp32)."""
    g = g_idx.long()
    w = (intweight.float() - zeros.float()[:, g]) * scales.float()[:, g]
    return w.to(scales.dtype)


# ---- per-channel int8 / fp8 ---------------------------------------------------------------------

def quantize_int8_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: w [out, in] float -> (int8 [out, in] in -127..127,
    scale fp32 [out]) with ``w ~= q * scale[:, None]``."""
    amax = w.detach().float().abs().amax(dim=1).clamp(min=1e-8)
    scale = amax / 127.0
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


FP8_E4M3_MAX = 448.0


def quantize_fp8_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel fp8 e4m3: w [out, in] float -> (float8_e4m3fn [out, in], scale fp32
    [out]) with ``w ~= q.float() * scale[:, None]`` (the channel's absmax maps to 448)."""
    amax = w.detach().float().abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / FP8_E4M3_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale
