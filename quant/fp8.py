"""``fp8``: fp8 e4m3 weights with one scale per output channel; on GPUs with fp8 tensor cores
(compute capability 8.9+, e.g. H100/H200) activations are quantized to fp8 per token and the
GEMM is ``torch._scaled_mm`` with row-wise scales; elsewhere (CPU, older GPUs) the weight is
dequantized to the model dtype and multiplied (W8A16).

A 16-bit checkpoint is quantized at load (``quantization: fp8``; absmax of each output channel
maps to 448). An fp8 checkpoint (config.json ``quantization_config``: ``quant_method: fp8``, as
vLLM / llm-compressor write it) gives ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale``
(a scalar per tensor, ``[out]`` or ``[out, 1]``); ``activation_scheme: static`` (``input_scale``)
and block-wise scales (``weight_block_size``) are not supported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagebatch.hookspecs import hookimpl
from pagebatch.layers.linear import LinearBase, QuantMethod

from .common import (as_rows, check_allowed, config_field, load_dummy_per_channel,
                     load_per_channel, make_bias)
from .packing import quantize_fp8_per_channel


def _scaled_mm_ok(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_matmul(x: Tensor, w_t: Tensor, w_scale: Tensor) -> Tensor:
    """x [T, K] bf16/fp16 (CUDA, unit stride along K), w_t [K, N] float8_e4m3fn column-major (a
    transposed [N, K] row-major tensor), w_scale [1, N] fp32 -> [T, N] in x's dtype. Per-token
    dynamic fp8 activations from one Triton launch (quant/kernels/per_token_quant.py: absmax
    / 448 per row, clamp, round-to-nearest-even cast, the same bits as the torch formula), then
    ``torch._scaled_mm`` (K and N multiples of 16) writing bf16 directly; fp16 goes through a
    bf16 output and a cast, as row-wise scaling in older torch releases supports only bf16."""
    from .kernels.per_token_quant import per_token_quant

    xq, x_scale = per_token_quant(x, torch.float8_e4m3fn)
    out_dtype = x.dtype if x.dtype == torch.bfloat16 else torch.bfloat16
    out = torch._scaled_mm(xq, w_t, scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class FP8Method(QuantMethod):
    name = "fp8"

    def __init__(self, config=None, hf_quant_config=None):
        super().__init__(config, hf_quant_config)
        hf = hf_quant_config
        check_allowed("fp8", "activation_scheme",
                      config_field(hf, ("activation_scheme",), "dynamic"), ("dynamic",))
        check_allowed("fp8", "weight_block_size",
                      config_field(hf, ("weight_block_size",), None), (None,))
        check_allowed("fp8", "fmt", config_field(hf, ("fmt",), "e4m3"), ("e4m3",))

    def create_weights(self, layer: LinearBase, dtype, device):
        n, k = layer.output_size, layer.input_size
        layer.register_buffer("weight", torch.zeros(n, k, dtype=torch.float8_e4m3fn,
                                                    device=device))
        layer.register_buffer("weight_scale", torch.ones(n, dtype=torch.float32,
                                                         device=device))
        layer.use_scaled_mm = False
        make_bias(layer, dtype, device)

    def load_weight(self, layer: LinearBase, name, tensor, shard):
        load_per_channel(self.name, layer, name, tensor, shard, torch.float8_e4m3fn,
                         quantize_fp8_per_channel)

    def load_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        load_dummy_per_channel(layer, generator, quantize_fp8_per_channel)

    def process_weights_after_loading(self, layer: LinearBase):
        n, k = layer.weight.shape
        layer.use_scaled_mm = _scaled_mm_ok(layer.weight.device) and n % 16 == 0 and k % 16 == 0

    def dequantized_weight(self, layer: LinearBase) -> Tensor:
        """W ``[N, K]`` fp32."""
        return layer.weight.float() * layer.weight_scale[:, None]

    def apply(self, layer: LinearBase, x):
        if layer.use_scaled_mm and x.dtype in (torch.bfloat16, torch.float16):
            out = fp8_matmul(as_rows(x), layer.weight.t(), layer.weight_scale[None, :])
            out = out.reshape(*x.shape[:-1], out.shape[-1])
        else:
            w = layer.weight.to(x.dtype) * layer.weight_scale[:, None].to(x.dtype)
            out = x @ w.t()
        if layer.bias is not None:
            out = out + layer.bias
        return out


@hookimpl
def register_quant_methods(register):
    register("fp8", FP8Method)
