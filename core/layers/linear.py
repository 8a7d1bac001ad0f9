"""Linear layers and the `QuantMethod` interface that quantization plugins implement.

A linear layer does not own its weight format: its quant method creates the parameter tensors,
loads checkpoint tensors into them and applies the layer. Merged layers (fused QKV, gate/up) take
several checkpoint tensors, one per output shard, stacked along the output dimension.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019). A layer is built with the *checkpoint's*
sizes and a ``parallel`` kind:

- ``"column"``: each of the ``tp_size`` ranks holds a slice of every output shard's rows
  (``output_ranges``: by default an even split; fused QKV passes its own, see
  `qkv_output_ranges`, where KV heads are replicated when there are fewer than ranks). The
  output stays split: the next layer (row-parallel, or attention over this rank's heads) takes
  it as it is.
- ``"row"``: each rank holds a slice of the input columns (``input_range``) and computes a
  partial sum of the output; `forward` all-reduces it over the TP group.
- ``None``: replicated (every rank holds the whole layer).

What a `QuantMethod` must do under TP (the contract every plugin keeps):

1. ``create_weights`` sizes its tensors from this rank's sizes: ``layer.input_size``,
   ``layer.output_sizes`` / ``layer.output_size`` (already divided). The checkpoint's sizes are
   ``layer.full_input_size`` / ``layer.full_output_sizes`` (e.g. GPTQ act-order on a
   row-parallel layer keeps every group's scales: ``full_input_size // group_size`` rows).
2. ``load_weight`` receives checkpoint tensors in their full checkpoint shape and cuts this
   rank's part with ``layer.shard_checkpoint_tensor(tensor, shard, output_dim=..., input_dim=...,
   output_pack=..., input_pack=...)``, naming which tensor dimension runs along the layer's
   outputs and which along its inputs, and how many logical rows/columns one stored element
   covers there (``pack``: 8 for 4-bit values packed in int32, ``group_size`` for per-group
   scales and zeros). A tensor with no input dimension (per-output-channel scales, bias) passes
   only ``output_dim``; one that must stay whole on every rank (act-order scales of a row-
   parallel layer) passes only the dimensions that are split. Then it copies the part into the
   shard's place, ``layer.shard_offset(shard)`` (per-rank offsets), as without TP. With
   ``tp_size == 1`` the helper returns the tensor unchanged.
3. The bias of a row-parallel layer is loaded whole and added on every rank before the
   all-reduce; `LinearBase.load` therefore hands ``load_weight`` zeros for ``"bias"`` on TP
   ranks > 0, so the sum adds it once. A method need do nothing for this.
4. ``apply`` computes this rank's ``x [T, input_size] -> [T, output_size]``; the all-reduce of a
   row-parallel layer is the layer's, not the method's.
5. Alignment: a split must fall on a whole stored element (a packed word, a group): the helper
   raises ValueError naming the layer's sizes otherwise (e.g. a row-parallel input slice that is
   not a multiple of the group size).

Example, AutoGPTQ ``qweight [in/8, out]``: ``shard_checkpoint_tensor(t, shard, input_dim=0,
input_pack=8, output_dim=1)``; AutoAWQ ``qzeros [in/g, out/8]``: ``input_dim=0, input_pack=g,
output_dim=1, output_pack=8``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..distributed.parallel_state import ParallelContext

PARALLEL_KINDS = (None, "column", "row")


class QuantMethod(ABC):
    """How one kind of weight is stored, loaded and multiplied. Plugins implement this.

    Registered with ``register_quant_methods``; constructed as ``cls(config, hf_quant_config)``.
    Under tensor parallelism see the module docstring for what each method must do.
    """

    name: str = "?"
    checkpoint_lm_head: bool = False
    """Whether the checkpoint stores the LM head in this method's format (GPTQModel's
    ``lm_head: true``); the engine then builds the LM head with this method."""

    def __init__(self, config: object | None = None, hf_quant_config: dict | None = None):
        self.config = config
        self.hf_quant_config = hf_quant_config

    @abstractmethod
    def create_weights(self, layer: "LinearBase", dtype: torch.dtype,
                       device: torch.device) -> None:
        """Register the layer's parameters (for this rank's ``output_sizes`` x
        ``input_size``)."""

    @abstractmethod
    def load_weight(self, layer: "LinearBase", name: str, tensor: torch.Tensor,
                    shard: int | None) -> None:
        """Copy checkpoint tensor ``name`` (e.g. "weight", "bias") of output shard ``shard``
        (None for an unmerged layer) into the layer; ``tensor`` has its full checkpoint shape
        (cut it with ``layer.shard_checkpoint_tensor``). Raises ValueError on a shape
        mismatch."""

    @abstractmethod
    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, input_size] -> [num_tokens, sum(output_sizes)] (this rank's)."""

    def apply_silu_mul(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor | None:
        """Optional fusion: for a layer whose two output shards are gate and up (of equal
        size D), ``silu(gate) * up`` of the product in one kernel, x ``[T, input_size]`` ->
        ``[T, D]``; None where the method has no such kernel for these inputs (the default),
        and the caller runs `apply` and the activation."""
        return None

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Repack once after every tensor is loaded (e.g. transpose for a kernel)."""

    def load_dummy_weights(self, layer: "LinearBase", generator: torch.Generator) -> None:
        """Random weights for ``load_format: dummy``, made on the layer's device with
        ``generator`` (a generator of that device); ``process_weights_after_loading`` follows.
        Default: N(0, 0.02) for the layer's floating parameters and buffers, uniform over the
        range for integer ones. Quantized methods override it (e.g. quantize random 16-bit
        weights the way a checkpoint would be)."""
        for t in [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]:
            if t.is_floating_point():
                t.data.normal_(0.0, 0.02, generator=generator)
            else:
                info = torch.iinfo(t.dtype)
                t.data.copy_(torch.randint(info.min, info.max, t.shape, generator=generator,
                                           device=t.device, dtype=t.dtype))


def tp_partition(size: int, unit: int, tp_rank: int, tp_size: int,
                 replicate: bool = False) -> tuple[int, int]:
    """(start, length) of rank ``tp_rank``'s slice of ``size`` split in whole ``unit``s (a head
    dimension, or 1). With ``replicate``, fewer units than ranks are shared: each rank holds one
    unit, ``tp_size / units`` consecutive ranks the same one. Raises ValueError when the units
    do not split evenly."""
    if size % unit:
        raise ValueError(f"size {size} is not a multiple of {unit}")
    n = size // unit
    if n % tp_size == 0:
        per = n // tp_size
        return tp_rank * per * unit, per * unit
    if replicate and n < tp_size and tp_size % n == 0:
        return (tp_rank * n // tp_size) * unit, unit
    raise ValueError(f"{n} x {unit} does not split over tensor_parallel_size={tp_size}")


def qkv_output_ranges(num_heads: int, num_kv_heads: int, head_dim: int, tp_rank: int,
                      tp_size: int) -> list[tuple[int, int]]:
    """This rank's (start, length) in the q, k and v shards of a fused QKV projection: q heads
    split evenly; KV heads split evenly, or replicated when fewer than the ranks (rank r then
    holds KV head ``r * num_kv_heads // tp_size``, the one its q heads attend with)."""
    q = tp_partition(num_heads * head_dim, head_dim, tp_rank, tp_size)
    kv = tp_partition(num_kv_heads * head_dim, head_dim, tp_rank, tp_size, replicate=True)
    return [q, kv, kv]


class LinearBase(nn.Module):
    """``y = x W^T (+ b)`` with W made of ``output_sizes`` shards stacked on the output dim.

    ``input_size`` / ``output_sizes``: the checkpoint's sizes. ``parallel``: None, "column" or
    "row" (see the module docstring); ``tp``: the `ParallelContext` (None: a single rank);
    ``output_ranges``: a column-parallel layer's (start, length) per output shard (default: an
    even split). ``reduce_results=False``: a row-parallel layer returns this rank's partial
    sum, which the caller reduces (an RMSNorm built with ``tp``, core/layers/norm.py, fuses
    that all-reduce with its residual add). After construction ``input_size``,
    ``output_sizes`` and ``output_size`` are this rank's; ``full_input_size`` /
    ``full_output_sizes`` the checkpoint's.
    Raises ValueError when the sizes do not split over the TP ranks.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 quant_method: QuantMethod, dtype: torch.dtype, device: torch.device, *,
                 parallel: str | None = None, tp: "ParallelContext | None" = None,
                 output_ranges: list[tuple[int, int]] | None = None,
                 reduce_results: bool = True):
        super().__init__()
        if parallel not in PARALLEL_KINDS:
            raise ValueError(f"parallel={parallel!r}; allowed: {list(PARALLEL_KINDS)}")
        self.tp = tp
        self.reduce_results = reduce_results
        self.tp_rank = tp.tp_rank if tp is not None else 0
        self.tp_size = tp.tp_size if tp is not None else 1
        self.parallel = parallel if self.tp_size > 1 else None
        self.full_input_size = input_size
        self.full_output_sizes = list(output_sizes)
        self.input_range = (0, input_size)
        self.output_ranges = [(0, s) for s in output_sizes]
        if self.parallel == "column":
            self.output_ranges = list(output_ranges) if output_ranges is not None else [
                tp_partition(s, 1, self.tp_rank, self.tp_size) for s in output_sizes]
        elif self.parallel == "row":
            self.input_range = tp_partition(input_size, 1, self.tp_rank, self.tp_size)
        self.input_size = self.input_range[1]
        self.output_sizes = [n for _, n in self.output_ranges]
        self.output_size = sum(self.output_sizes)
        self.has_bias = bias
        self.quant_method = quant_method
        quant_method.create_weights(self, dtype, device)

    def shard_offset(self, shard: int | None) -> tuple[int, int]:
        """(start, size) of an output shard along this rank's output dimension."""
        if shard is None:
            return 0, self.output_size
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def shard_checkpoint_tensor(self, tensor: torch.Tensor, shard: int | None, *,
                                output_dim: int | None = None, input_dim: int | None = None,
                                output_pack: int = 1, input_pack: int = 1) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (a view). ``output_dim``: the dimension of
        ``tensor`` along the outputs of shard ``shard`` (cut on a column-parallel layer);
        ``input_dim``: the dimension along the inputs (cut on a row-parallel layer);
        ``*_pack``: logical rows/columns per stored element along that dimension. Raises
        ValueError when the cut does not fall on whole stored elements."""
        if self.parallel == "column" and output_dim is not None:
            start, size = self.output_ranges[0 if shard is None else shard]
            tensor = self._narrow(tensor, output_dim, start, size, output_pack, "output")
        elif self.parallel == "row" and input_dim is not None:
            start, size = self.input_range
            tensor = self._narrow(tensor, input_dim, start, size, input_pack, "input")
        return tensor

    def _narrow(self, t: torch.Tensor, dim: int, start: int, size: int, pack: int,
                what: str) -> torch.Tensor:
        if start % pack or size % pack:
            raise ValueError(
                f"tensor parallel rank {self.tp_rank}/{self.tp_size} holds {what}s "
                f"[{start}, {start + size}) of this layer, which is not a whole number of "
                f"stored elements of {pack} {what}s each (layer {self.full_input_size} -> "
                f"{self.full_output_sizes})")
        return t.narrow(dim, start // pack, size // pack)

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if name == "bias" and self.parallel == "row" and self.tp_rank > 0:
            tensor = torch.zeros_like(tensor)  # added once: by rank 0, before the all-reduce
        self.quant_method.load_weight(self, name, tensor, shard)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gate/up layer (two equal output shards, not row-parallel): SiLU-and-mul of
        the product ``[T, D]`` where the quant method fuses it (`QuantMethod.apply_silu_mul`),
        else None."""
        if self.parallel == "row" or len(self.output_sizes) != 2 or (
                self.output_sizes[0] != self.output_sizes[1]):
            return None
        return self.quant_method.apply_silu_mul(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        if self.parallel == "row" and self.reduce_results:
            y = self.tp.tp_all_reduce(y)
        return y
