"""``int8``: W8A8 — int8 weights with one scale per output channel, activations quantized per
token on the fly, an int8 GEMM (``torch._int_mm``) with both scales applied to its int32 result.

Checkpoint tensors per linear layer (compressed-tensors' / vLLM's channel-wise W8A8 names):
``weight`` int8 ``[out, in]`` and ``weight_scale`` float ``[out]`` or ``[out, 1]``, with
``w ~= weight * weight_scale``; optional ``bias``. A 16-bit ``weight`` (any checkpoint with
``quantization: int8``) is quantized at load, symmetric per output channel (absmax / 127).
config.json ``quantization_config``: ``{"quant_method": "int8"}``, optionally ``bits: 8`` and
``activation_scheme: dynamic`` (static activation scales are not supported).

``torch._int_mm`` on CUDA needs more than 16 rows and K, N multiples of 8: decode batches of at
most 16 tokens are padded to 32 rows; layers with K or N not a multiple of 8 (and the CPU) run the
same arithmetic in floating point.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagebatch.hookspecs import hookimpl
from pagebatch.layers.linear import LinearBase, QuantMethod

from .common import (check_allowed, config_field, copy_rows, load_bias, load_dummy_per_channel,
                     make_bias)
from .packing import quantize_int8_per_channel

INT_MM_MIN_ROWS = 17  # torch._int_mm (cuBLASLt) needs more than 16 rows
INT_MM_PAD_ROWS = 32


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, K] float -> (int8 [T, K], scale fp32 [T, 1]), symmetric absmax / 127 per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


def int8_matmul(xq: Tensor, x_scale: Tensor, w_t: Tensor, w_scale: Tensor,
                out_dtype: torch.dtype) -> Tensor:
    """xq [T, K] int8, x_scale [T, 1] fp32, w_t [K, N] int8 (contiguous), w_scale [N] fp32
    -> [T, N] ``out_dtype``: ``(xq @ w_t) * x_scale * w_scale``."""
    t, k = xq.shape
    n = w_t.shape[1]
    if xq.is_cuda and k % 8 == 0 and n % 8 == 0:
        if t < INT_MM_MIN_ROWS:
            xq = torch.nn.functional.pad(xq, (0, 0, 0, INT_MM_PAD_ROWS - t))
        acc = torch._int_mm(xq.contiguous(), w_t)[:t].float()
    else:  # exact for |sum| < 2**24; beyond, fp32 rounding of an int32 sum
        acc = xq.float() @ w_t.float()
    return (acc * x_scale * w_scale).to(out_dtype)


class Int8Method(QuantMethod):
    name = "int8"

    def __init__(self, config=None, hf_quant_config=None):
        super().__init__(config, hf_quant_config)
        hf = hf_quant_config
        check_allowed("int8", "bits", int(config_field(hf, ("bits",), 8)), (8,))
        check_allowed("int8", "activation_scheme",
                      config_field(hf, ("activation_scheme",), "dynamic"), ("dynamic",))

    def create_weights(self, layer: LinearBase, dtype, device):
        n, k = layer.output_size, layer.input_size
        layer.register_buffer("weight", torch.zeros(n, k, dtype=torch.int8, device=device))
        layer.register_buffer("weight_scale", torch.zeros(n, dtype=torch.float32,
                                                          device=device))
        layer.register_buffer("weight_t", None)  # [K, N] contiguous, after loading
        make_bias(layer, dtype, device)

    def load_weight(self, layer: LinearBase, name, tensor, shard):
        start, size = layer.shard_offset(shard)
        if name == "bias":
            return load_bias(self.name, layer, tensor, shard)
        if name == "weight":  # [out, in]
            tensor = layer.shard_checkpoint_tensor(tensor, shard, output_dim=0, input_dim=1)
            if tensor.dtype == torch.int8:
                copy_rows(self.name, layer.weight.narrow(0, start, size), name, tensor, shard)
                return
            q, s = quantize_int8_per_channel(tensor.to(layer.weight.device))
            copy_rows(self.name, layer.weight.narrow(0, start, size), name, q, shard)
            layer.weight_scale[start:start + size] = s
            return
        if name == "weight_scale":  # [out], [out, 1] or a scalar
            if tensor.dim() > 0 and tensor.shape[0] > 1:
                tensor = layer.shard_checkpoint_tensor(tensor, shard, output_dim=0)
            t = tensor.reshape(-1) if tensor.dim() == 2 and tensor.shape[1] == 1 else tensor
            copy_rows(self.name, layer.weight_scale.narrow(0, start, size), name, t.float(),
                      shard)
            return
        raise ValueError(f"int8: unexpected checkpoint tensor {name!r} (expected weight, "
                         f"weight_scale, bias; static activation scales are not supported)")

    def load_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        load_dummy_per_channel(layer, generator, quantize_int8_per_channel)

    def process_weights_after_loading(self, layer: LinearBase):
        layer.weight_t = layer.weight.t().contiguous()  # cuBLASLt wants mat2 contiguous
        layer.weight = None

    def dequantized_weight(self, layer: LinearBase) -> Tensor:
        """W ``[N, K]`` fp32."""
        return (layer.weight_t.float() * layer.weight_scale).t()

    def apply(self, layer: LinearBase, x):
        xq, xs = quantize_per_token(x)
        out = int8_matmul(xq, xs, layer.weight_t, layer.weight_scale, x.dtype)
        if layer.bias is not None:
            out = out + layer.bias
        return out


@hookimpl
def register_quant_methods(register):
    register("int8", Int8Method)
