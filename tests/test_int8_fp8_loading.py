"""The int8 / fp8 quant methods' checkpoint loading of weight scales: per channel and per tensor
(CPU, no kernels)."""

from __future__ import annotations

import pytest
import torch

from pagebatch.layers.linear import LinearBase
from pagebatch.quant.fp8 import FP8Method
from pagebatch.quant.int8 import Int8Method


def _layer(method_cls):
    method = method_cls(None, {"quant_method": method_cls.name})
    return method, LinearBase(16, [8], False, method, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("shape", [(), (1,), (8,), (8, 1)], ids=str)
def test_fp8_weight_scale_shapes(shape):
    method, layer = _layer(FP8Method)
    layer.load("weight", torch.randn(8, 16).to(torch.float8_e4m3fn), None)
    layer.load("weight_scale", torch.full(shape, 0.01), None)
    method.process_weights_after_loading(layer)
    assert torch.allclose(layer.weight_scale, torch.full((8,), 0.01))


@pytest.mark.parametrize("shape", [(8,), (8, 1)], ids=str)
def test_int8_weight_scale_per_channel(shape):
    method, layer = _layer(Int8Method)
    layer.load("weight", torch.randint(-127, 128, (8, 16), dtype=torch.int8), None)
    layer.load("weight_scale", torch.full(shape, 0.01), None)
    assert torch.allclose(layer.weight_scale, torch.full((8,), 0.01))


@pytest.mark.parametrize("shape", [(), (1,)], ids=str)
def test_int8_per_tensor_weight_scale(shape):
    """A per-tensor ``weight_scale`` (compressed-tensors strategy "tensor"; a scalar or [1])
    applies to every output row, as fp8 does."""
    method, layer = _layer(Int8Method)
    layer.load("weight", torch.randint(-127, 128, (8, 16), dtype=torch.int8), None)
    layer.load("weight_scale", torch.full(shape, 0.01), None)
    assert torch.allclose(layer.weight_scale, torch.full((8,), 0.01))
