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

from .common import (check_allowed, config_field, copy_rows, load_bias, load_dummy_per_channel,
                     make_bias)
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
        self.from_checkpoint = bool(hf)
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
        start, size = layer.shard_offset(shard)
        if name == "bias":
            return load_bias(self.name, layer, tensor, shard)
        rows = layer.weight.narrow(0, start, size)
        if name == "weight":  # [out, in]
            tensor = layer.shard_checkpoint_tensor(tensor, shard, output_dim=0, input_dim=1)
            if self.from_checkpoint or tensor.dtype == torch.float8_e4m3fn:
                # fp8 values (the loader may have widened them to the model dtype: exact)
                copy_rows(self.name, rows, name, tensor.to(torch.float8_e4m3fn), shard)
            else:
                q, s = quantize_fp8_per_channel(tensor.to(rows.device))
                copy_rows(self.name, rows, name, q, shard)
                layer.weight_scale[start:start + size] = s
            return
        if name == "weight_scale":  # [out], [out, 1] or a scalar
            if tensor.dim() > 0 and tensor.shape[0] > 1:
                tensor = layer.shard_checkpoint_tensor(tensor, shard, output_dim=0)
            t = tensor.float().reshape(-1)
            if t.numel() == 1:  # per-tensor: broadcast over the shard's rows
                t = t.expand(size)
            copy_rows(self.name, layer.weight_scale.narrow(0, start, size), name, t, shard)
            return
        raise ValueError(f"fp8: unexpected checkpoint tensor {name!r} (expected weight, "
                         f"weight_scale, bias; static activation scales are not supported)")

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
            x2 = x.reshape(-1, x.shape[-1])
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            out = fp8_matmul(x2, layer.weight.t(), layer.weight_scale[None, :])
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
