"""``fp16``: unquantized weights kept in the configured dtype (fp32, bf16 or fp16)."""

from __future__ import annotations

import torch
from torch import nn

from pagebatch.hookspecs import hookimpl
from pagebatch.layers.dense import cpu_weights, dense_linear, dense_linear_silu_mul
from pagebatch.layers.linear import LinearBase, QuantMethod


class UnquantizedMethod(QuantMethod):
    name = "fp16"

    def create_weights(self, layer: LinearBase, dtype, device):
        layer.weight = nn.Parameter(
            torch.empty(layer.output_size, layer.input_size, dtype=dtype, device=device),
            requires_grad=False)
        layer.bias = (nn.Parameter(torch.zeros(layer.output_size, dtype=dtype, device=device),
                                   requires_grad=False) if layer.has_bias else None)
        layer.cpu_weights = None  # made after loading (fp32 on the CPU)

    def load_weight(self, layer: LinearBase, name, tensor, shard):
        param = getattr(layer, name, None)
        if param is None:
            raise ValueError(f"layer has no {name!r} (bias={layer.has_bias})")
        # weight [out, in], bias [out]: this rank's rows (column) or columns (row parallel)
        tensor = layer.shard_checkpoint_tensor(tensor, shard, output_dim=0,
                                               input_dim=1 if name == "weight" else None)
        start, size = layer.shard_offset(shard)
        dst = param.data.narrow(0, start, size)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match "
                             f"the layer's {tuple(dst.shape)} (shard {shard})")
        dst.copy_(tensor)

    def process_weights_after_loading(self, layer: LinearBase):
        """fp32 on the CPU: the weight's transposed and oneDNN-blocked copies
        (core/layers/dense.py); the ``[N, K]`` weight itself becomes a view of the transposed
        copy, so the layer holds its bytes twice, not three times."""
        cw = layer.cpu_weights = cpu_weights(layer.weight)
        if cw is not None:
            layer.weight.data = cw.t.t()

    def apply(self, layer: LinearBase, x):
        return dense_linear(x, layer.weight, layer.bias, layer.cpu_weights)

    def apply_silu_mul(self, layer: LinearBase, x):
        """The 16-bit GEMV's gated epilogue where its table chose the GEMV (decode sizes)."""
        return dense_linear_silu_mul(x, layer.weight, layer.bias)


@hookimpl
def register_quant_methods(register):
    register("fp16", UnquantizedMethod)
