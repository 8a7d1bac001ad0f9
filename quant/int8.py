"""``int8``: W8A8 — int8 weights with one scale per output channel, activations quantized per
token on the fly, an int8 GEMM with both scales applied to its int32 result.

Checkpoint tensors per linear layer (compressed-tensors' / vLLM's channel-wise W8A8 names):
``weight`` int8 ``[out, in]`` and ``weight_scale`` float ``[out]`` or ``[out, 1]``, with
``w ~= weight * weight_scale``; optional ``bias``. A 16-bit ``weight`` (any checkpoint with
``quantization: int8``) is quantized at load, symmetric per output channel (absmax / 127).
config.json ``quantization_config``: ``{"quant_method": "int8"}``, optionally ``bits: 8`` and
``activation_scheme: dynamic`` (static activation scales are not supported).

On CUDA ``apply`` is two Triton launches (quant/kernels/): `per_token_quant` (one pass per row,
the same int8 values and scales as `quantize_per_token`) and `int8_scaled_mm` (int32 tensor-core
accumulation over the int8 ``weight`` kept ``[N, K]`` as loaded; scales and bias applied in its
epilogue, the output written once in x's dtype). Any M, N, K. Elsewhere (the CPU) the same
arithmetic runs in floating point.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagebatch.hookspecs import hookimpl
from pagebatch.layers.linear import LinearBase, QuantMethod

from .common import (as_rows, check_allowed, config_field, load_dummy_per_channel,
                     load_per_channel, make_bias)
from .packing import quantize_int8_per_channel

_kernels = None


def _kernel_modules():
    """(per_token_quant module, int8_gemm module), imported on first CUDA use (Triton)."""
    global _kernels
    if _kernels is None:
        from .kernels import int8_gemm, per_token_quant

        _kernels = (per_token_quant, int8_gemm)
    return _kernels


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, K] float -> (int8 [T, K], scale fp32 [T, 1]), symmetric absmax / 127 per row
    (the torch reference of quant/kernels/per_token_quant.py, which computes the same bits)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


def int8_matmul(xq: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                out_dtype: torch.dtype) -> Tensor:
    """xq [T, K] int8, x_scale [T, 1] fp32, w [N, K] int8, w_scale [N] fp32 -> [T, N]
    ``out_dtype``: ``(xq @ w.T) * x_scale * w_scale``. CUDA: the Triton int8 GEMM; elsewhere in
    fp32, exact for |sum| < 2**24 (beyond, fp32 rounding of the int32 sum)."""
    if xq.is_cuda:
        return _kernel_modules()[1].int8_scaled_mm(xq, x_scale, w, w_scale, out_dtype)
    acc = xq.float() @ w.float().t()
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
        make_bias(layer, dtype, device)

    def load_weight(self, layer: LinearBase, name, tensor, shard):
        load_per_channel(self.name, layer, name, tensor, shard, torch.int8,
                         quantize_int8_per_channel)

    def load_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        load_dummy_per_channel(layer, generator, quantize_int8_per_channel)

    def process_weights_after_loading(self, layer: LinearBase):
        layer.weight = layer.weight.contiguous()  # [N, K], K contiguous: the GEMM's B layout

    def dequantized_weight(self, layer: LinearBase) -> Tensor:
        """W ``[N, K]`` fp32."""
        return layer.weight.float() * layer.weight_scale[:, None]

    def apply(self, layer: LinearBase, x):
        if x.is_cuda:  # two launches; the bias is added in fp32 in the GEMM's epilogue
            quant, gemm = _kernel_modules()
            xq, xs = quant.per_token_quant(as_rows(x), torch.int8)
            out = gemm.int8_scaled_mm(xq, xs, layer.weight, layer.weight_scale, x.dtype,
                                      layer.bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        xq, xs = quantize_per_token(x)
        out = int8_matmul(xq, xs, layer.weight, layer.weight_scale, x.dtype)
        if layer.bias is not None:
            out = out + layer.bias
        return out


@hookimpl
def register_quant_methods(register):
    register("int8", Int8Method)
