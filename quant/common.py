"""What the quant method plugins share: reading a checkpoint's ``quantization_config`` (with an
error that names the field and the value), copying a checkpoint tensor into an output shard,
round-to-nearest quantization for methods that quantize a 16-bit checkpoint at load time, and the
random weights of ``load_format: dummy``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from pagebatch.errors import ConfigError
from pagebatch.layers.linear import LinearBase

__all__ = ["ConfigError", "config_field", "check_allowed", "copy_rows", "make_bias",
           "load_bias", "rtn_quantize"]


def config_field(hf: dict | None, names: Sequence[str], default: Any) -> Any:
    """The first of ``names`` present in the checkpoint's quantization config, else
    ``default`` (AutoAWQ writes ``bits``/``group_size`` in config.json but ``w_bit``/
    ``q_group_size`` in quant_config.json; GPTQModel writes ``format`` or
    ``checkpoint_format``)."""
    for n in names:
        if hf and hf.get(n) is not None:
            return hf[n]
    return default


def check_allowed(method: str, field: str, value: Any, allowed: Sequence[Any]) -> None:
    """Raise ConfigError naming the quantization_config field and value unless allowed."""
    if value not in allowed:
        raise ConfigError(f"quantization {method!r}: quantization_config.{field}={value!r} is "
                          f"not supported (supported: {list(allowed)})")


def shape_error(method: str, name: str, got: Sequence[int], want: Sequence[int],
                shard: int | None) -> ValueError:
    return ValueError(f"{method}: checkpoint tensor {name!r} has shape {tuple(got)}, the layer "
                      f"expects {tuple(want)} (output shard {shard})")


def copy_rows(method: str, dst: Tensor, name: str, src: Tensor, shard: int | None) -> None:
    """Copy ``src`` into ``dst`` (a view of one shard's rows) after a shape check."""
    if tuple(dst.shape) != tuple(src.shape):
        raise shape_error(method, name, src.shape, dst.shape, shard)
    dst.copy_(src)


def make_bias(layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
    layer.bias = (nn.Parameter(torch.zeros(layer.output_size, dtype=dtype, device=device),
                               requires_grad=False) if layer.has_bias else None)


def load_bias(method: str, layer: LinearBase, tensor: Tensor, shard: int | None) -> None:
    if layer.bias is None:
        raise ValueError(f"{method}: checkpoint has a bias but the layer has none")
    tensor = layer.shard_checkpoint_tensor(tensor, shard, output_dim=0)
    start, size = layer.shard_offset(shard)
    copy_rows(method, layer.bias.data.narrow(0, start, size), "bias", tensor, shard)


def as_rows(x: Tensor) -> Tensor:
    """``x [..., K]`` as ``[T, K]`` with unit stride along K (a view when it already is), what
    the per-token quantization kernels take."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def load_channel_scale(method: str, layer: LinearBase, name: str, tensor: Tensor,
                       shard: int | None) -> None:
    """A per-channel weight scale (``[out]`` or ``[out, 1]``) or a per-tensor one (a scalar or
    ``[1]``, broadcast over the shard's rows) into ``layer.weight_scale`` (fp32 ``[out]``)."""
    start, size = layer.shard_offset(shard)
    if tensor.dim() > 0 and tensor.shape[0] > 1:
        tensor = layer.shard_checkpoint_tensor(tensor, shard, output_dim=0)
    t = tensor.float().reshape(-1)
    if t.numel() == 1:
        t = t.expand(size)
    copy_rows(method, layer.weight_scale.narrow(0, start, size), name, t, shard)


def load_per_channel(method: str, layer: LinearBase, name: str, tensor: Tensor,
                     shard: int | None, dtype: torch.dtype, quantize: Any) -> None:
    """One checkpoint tensor of a per-output-channel method (int8, fp8): ``weight`` ``[out,
    in]`` already in ``dtype`` (copied; the loader keeps 1-byte tensors as they are stored) or
    a 16-bit weight quantized at load by ``quantize(w) -> (weight, scale)`` (also the 16-bit
    LM head of a quantized checkpoint, ``quantize_lm_head``); ``weight_scale``
    (`load_channel_scale`); ``bias``. Raises ValueError for other names."""
    if name == "bias":
        return load_bias(method, layer, tensor, shard)
    if name == "weight_scale":  # [out], [out, 1] or a scalar
        return load_channel_scale(method, layer, name, tensor, shard)
    if name != "weight":
        raise ValueError(f"{method}: unexpected checkpoint tensor {name!r} (expected weight, "
                         f"weight_scale, bias; static activation scales are not supported)")
    start, size = layer.shard_offset(shard)
    rows = layer.weight.narrow(0, start, size)
    tensor = layer.shard_checkpoint_tensor(tensor, shard, output_dim=0, input_dim=1)
    if tensor.dtype == dtype:
        copy_rows(method, rows, name, tensor.to(dtype), shard)
    else:
        q, s = quantize(tensor.to(rows.device))
        copy_rows(method, rows, name, q, shard)
        layer.weight_scale[start:start + size] = s


def load_dummy_per_channel(layer: LinearBase, generator: torch.Generator,
                           quantize: Any) -> None:
    """N(0, 0.02) weights made on the layer's device and quantized per output channel by
    ``quantize(w [out, in]) -> (weight, scale [out])`` as a checkpoint would be (int8, fp8)."""
    w = torch.empty(layer.weight.shape, device=layer.weight.device)
    w.normal_(0.0, 0.02, generator=generator)
    q, s = quantize(w)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(s)
    if layer.bias is not None:
        layer.bias.data.normal_(0.0, 0.02, generator=generator)


def rtn_quantize(w: Tensor, bits: int, group_size: int, sym: bool
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Round-to-nearest grouped quantization (AutoAWQ's ``pseudo_quantize_tensor`` grid).

    w: [out, in] float; group_size: divisor of ``in`` or -1. Returns (intweight int32 [out, in]
    in 0..2**bits-1, zeros int32 [out, G], scales fp32 [out, G]) with
    ``w ~= (intweight - zeros) * scales`` per group. ``sym``: zero point 2**(bits-1).
    """
    out, k = w.shape
    gs = k if group_size == -1 else group_size
    wg = w.float().reshape(out, k // gs, gs)
    qmax = 2**bits - 1
    if sym:
        scales = (wg.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp(min=1e-8)
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scales = ((hi - lo) / qmax).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, qmax)
    q = torch.round(wg / scales[..., None]) + zeros[..., None]
    q = q.clamp(0, qmax).reshape(out, k)
    return q.to(torch.int32), zeros.to(torch.int32), scales
