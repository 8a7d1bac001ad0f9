"""Linear layers and the `QuantMethod` interface that quantization plugins implement.

A linear layer does not own its weight format: its quant method creates the parameter tensors,
loads checkpoint tensors into them and applies the layer. Merged layers (fused QKV, gate/up) take
several checkpoint tensors, one per output shard, stacked along the output dimension.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class QuantMethod(ABC):
    """How one kind of weight is stored, loaded and multiplied. Plugins implement this.

    Registered with ``register_quant_methods``; constructed as ``cls(config, hf_quant_config)``.
    """

    name: str = "?"

    def __init__(self, config: object | None = None, hf_quant_config: dict | None = None):
        self.config = config
        self.hf_quant_config = hf_quant_config

    @abstractmethod
    def create_weights(self, layer: "LinearBase", dtype: torch.dtype,
                       device: torch.device) -> None:
        """Register the layer's parameters (for ``output_sizes`` x ``input_size``)."""

    @abstractmethod
    def load_weight(self, layer: "LinearBase", name: str, tensor: torch.Tensor,
                    shard: int | None) -> None:
        """Copy checkpoint tensor ``name`` (e.g. "weight", "bias") of output shard ``shard``
        (None for an unmerged layer) into the layer. Raises ValueError on a shape mismatch."""

    @abstractmethod
    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, input_size] -> [num_tokens, sum(output_sizes)]."""

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Repack once after every tensor is loaded (e.g. transpose for a kernel)."""


class LinearBase(nn.Module):
    """``y = x W^T (+ b)`` with W made of ``output_sizes`` shards stacked on the output dim."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 quant_method: QuantMethod, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.has_bias = bias
        self.quant_method = quant_method
        quant_method.create_weights(self, dtype, device)

    def shard_offset(self, shard: int | None) -> tuple[int, int]:
        """(start, size) of an output shard along the output dimension."""
        if shard is None:
            return 0, self.output_size
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        self.quant_method.load_weight(self, name, tensor, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)
