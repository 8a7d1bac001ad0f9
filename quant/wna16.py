"""`WNA16Method`: what ``awq`` and ``gptq`` share — 4- or 8-bit weights with per-group scales
and zero points, 16-bit activations — and the one layout both are repacked into at load.

Canonical layout (per linear layer, K = input features, N = output features, all shards):

- ``qweight`` int32 ``[K * bits / 32, N]``: packed along the input dimension, field ``j`` (bits
  ``bits*j ..``) of row ``r`` holding input ``r * 32/bits + j`` — AutoGPTQ's qweight layout, so
  GPTQ tensors without act-order are only placed, and AWQ tensors are unpacked and repacked once;
- ``scales`` and ``zeros`` ``[G, N]`` in the model dtype: ``w[k, n] = (q[k, n] - zeros[g, n]) *
  scales[g, n]`` with ``g = k // group_size`` (zero points kept as floats: small integers, exact
  in bf16/fp16);
- ``perm`` int64 ``[K]`` or None: act-order (GPTQ ``desc_act``) checkpoints have their input
  channels sorted by group once at load; ``apply`` gathers ``x[:, perm]``;
- ``g_idx`` int32 ``[K]`` or None: only when the sorted groups are not contiguous runs of
  ``group_size`` (a g_idx that no GPTQ tool writes, but accepted): the kernel then reads each
  row's group;
- ``shard_orders`` or None: the fallback for a merged layer (q/k/v, gate/up) whose output shards
  carry different act-order permutations (legal in the GPTQ format: shards calibrated apart).
  Each shard's columns are sorted by its own groups, ``perm`` and ``g_idx`` are None, and
  ``apply`` runs one gather and one product per shard, concatenating the outputs: a list of
  ``(start, size, perm or None, g_idx or None)`` in output order.

On CUDA ``apply`` runs the Triton kernels in quant/kernels/wna16.py; elsewhere it dequantizes and
multiplies in torch.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from pagebatch.layers.linear import LinearBase, QuantMethod

from .common import ConfigError, load_bias, make_bias, rtn_quantize, shape_error
from .packing import default_g_idx, pack_fields, unpack_fields

_kernels = None


def _kernel_module():
    global _kernels
    if _kernels is None:
        from .kernels import wna16

        _kernels = wna16
    return _kernels


def dequantize_canonical(qweight: Tensor, scales: Tensor, zeros: Tensor, bits: int,
                         group_size: int, g_idx: Tensor | None = None) -> Tensor:
    """Canonical tensors -> W^T ``[K, N]`` in ``scales``' dtype (computed in fp32). Rows are in
    the permuted input order when the layer has a ``perm``."""
    q = unpack_fields(qweight, bits, dim=0).float()
    if g_idx is not None:
        g = g_idx.long()
        return ((q - zeros.float()[g]) * scales.float()[g]).to(scales.dtype)
    k, n = q.shape
    w = (q.view(-1, group_size, n) - zeros.float()[:, None]) * scales.float()[:, None]
    return w.view(k, n).to(scales.dtype)


class WNA16Method(QuantMethod):
    """Base of ``awq`` and ``gptq``. Subclasses parse their config into ``bits``,
    ``group_size`` (-1: one group), ``has_zeros`` and ``sym`` (for 16-bit weights quantized at
    load), name the checkpoint tensors they take, and unpack one shard's tensors into the
    convention of quant/packing.py."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False
    checkpoint_names: tuple[str, ...] = ()

    @abstractmethod
    def required_names(self) -> set[str]:
        """Checkpoint tensors a shard needs before it can be unpacked."""

    @abstractmethod
    def unpack_shard(self, layer: LinearBase, shard: int | None, tensors: dict[str, Tensor]
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """One shard's checkpoint tensors -> (intweight int [size, K], zeros int [size, G],
        scales [size, G], g_idx int [K] or None). Raises ValueError on shapes."""

    # ---- layer tensors --------------------------------------------------------------------------

    def layer_group_size(self, k: int) -> int:
        """Group size of a layer whose checkpoint input size is ``k`` (-1: ``k``)."""
        gs = k if self.group_size == -1 else self.group_size
        if gs <= 0 or k % gs:
            raise ConfigError(f"quantization {self.name!r}: group_size={self.group_size} does "
                              f"not divide a layer's input size {k}")
        return gs

    def whole_groups(self, layer: LinearBase) -> bool:
        """Whether every TP rank keeps all the checkpoint's groups (act-order on a row-parallel
        layer: a rank's input channels belong to any group)."""
        return False

    def cut(self, layer: LinearBase, name: str, tensor: Tensor, shard: int | None) -> Tensor:
        """This TP rank's part of a checkpoint tensor (``layer.shard_checkpoint_tensor``)."""
        return tensor

    def create_weights(self, layer: LinearBase, dtype, device):
        k, n = layer.input_size, layer.output_size
        pf = 32 // self.bits
        if k % pf:
            raise ConfigError(f"quantization {self.name!r}: input size {k} is not a multiple of "
                              f"{pf} ({self.bits}-bit fields in int32)")
        gs = self.layer_group_size(layer.full_input_size)
        if self.whole_groups(layer):
            n_groups = layer.full_input_size // gs
        elif k % gs:
            raise ConfigError(f"quantization {self.name!r}: group size {gs} does not divide "
                              f"this tensor-parallel rank's input size {k}")
        else:
            n_groups = k // gs
        layer.register_buffer("qweight", torch.zeros(k // pf, n, dtype=torch.int32,
                                                     device=device))
        layer.register_buffer("scales", torch.zeros(n_groups, n, dtype=dtype, device=device))
        layer.register_buffer("zeros", torch.zeros(n_groups, n, dtype=dtype, device=device))
        layer.register_buffer("perm", None)
        layer.register_buffer("g_idx", None)
        layer.shard_orders = None
        layer.wgroup_size = gs
        layer.quant_pending = {}  # shard -> {checkpoint name: tensor}, until complete
        layer.quant_orders = {}  # shard -> its act-order (perm, sorted g_idx or None), or None
        make_bias(layer, dtype, device)

    def load_weight(self, layer: LinearBase, name, tensor, shard):
        if name == "bias":
            return load_bias(self.name, layer, tensor, shard)
        if name == "weight":  # a 16-bit checkpoint: round to nearest at load
            w = layer.shard_checkpoint_tensor(tensor, shard, output_dim=0, input_dim=1)
            w = w.to(layer.scales.device)
            q, z, s = rtn_quantize(w, self.bits, layer.wgroup_size, self.sym)
            return self.store_shard(layer, shard, q, z, s, None)
        if name not in self.checkpoint_names:
            raise ValueError(f"{self.name}: unexpected checkpoint tensor {name!r} (expected "
                             f"{sorted(self.checkpoint_names)} or weight/bias)")
        pending = layer.quant_pending.setdefault(shard, {})
        pending[name] = self.cut(layer, name, tensor, shard).to(layer.scales.device)
        if self.required_names() <= pending.keys() and (
                "g_idx" not in self.checkpoint_names or "g_idx" in pending):
            self.store_shard(layer, shard, *self.unpack_shard(layer, shard, pending))
            del layer.quant_pending[shard]

    def process_weights_after_loading(self, layer: LinearBase):
        for shard, pending in list(layer.quant_pending.items()):
            missing = self.required_names() - pending.keys()
            if missing:
                raise ValueError(f"{self.name}: output shard {shard} lacks checkpoint tensors "
                                 f"{sorted(missing)}")
            self.store_shard(layer, shard, *self.unpack_shard(layer, shard, pending))
        layer.quant_pending.clear()

    def store_shard(self, layer: LinearBase, shard: int | None, intweight: Tensor, zeros: Tensor,
                    scales: Tensor, g_idx: Tensor | None) -> None:
        """Write one shard (quant/packing.py convention) into the canonical tensors."""
        start, size = layer.shard_offset(shard)
        k = layer.input_size
        if tuple(intweight.shape) != (size, k):
            raise shape_error(self.name, "weight (unpacked)", intweight.shape, (size, k), shard)
        g = layer.scales.shape[0]
        if tuple(scales.shape) != (size, g) or tuple(zeros.shape) != (size, g):
            raise shape_error(self.name, "scales/zeros (unpacked)", scales.shape, (size, g),
                              shard)
        intweight = self._apply_act_order(layer, shard, intweight, g_idx)
        cols = slice(start, start + size)
        layer.qweight[:, cols] = pack_fields(intweight.t(), self.bits, dim=0)
        layer.scales[:, cols] = scales.t().to(layer.scales.dtype)
        layer.zeros[:, cols] = zeros.t().to(layer.zeros.dtype)

    def _apply_act_order(self, layer: LinearBase, shard: int | None, intweight: Tensor,
                         g_idx: Tensor | None) -> Tensor:
        """Sort the input channels by group (once, at load). The shards of a merged layer
        share one input and, as GPTQ's act-order permutation comes from the Hessian of that
        input, usually one g_idx: then the layer keeps one ``perm`` (the fast path). Shards
        with different g_idx (calibrated apart) switch the layer to ``shard_orders``."""
        k, gs = layer.input_size, layer.wgroup_size
        if g_idx is not None and not self.whole_groups(layer):
            g_idx = g_idx - layer.input_range[0] // gs  # a row-parallel rank's own groups
        key = None
        if g_idx is not None and not torch.equal(g_idx.long().cpu(),
                                                 default_g_idx(k, gs).long()):
            key = g_idx.long().cpu()
            if int(key.min()) < 0 or int(key.max()) >= layer.scales.shape[0]:
                raise ValueError(f"{self.name}: g_idx values must lie in "
                                 f"0..{layer.scales.shape[0] - 1}")
        order = None
        if key is not None:
            dev = layer.qweight.device
            perm = torch.argsort(key, stable=True)
            sorted_g = key[perm]
            contiguous = torch.equal(sorted_g, default_g_idx(k, gs).long())
            order = (perm.to(dev), None if contiguous else sorted_g.to(dev, torch.int32))
        layer.quant_orders[shard] = order
        self._set_orders(layer)
        return intweight if order is None else intweight[:, order[0].to(intweight.device)]

    @staticmethod
    def _set_orders(layer: LinearBase) -> None:
        """One ``perm``/``g_idx`` for the layer while every shard stored so far has the same
        act-order, else ``shard_orders`` (each shard's own)."""
        orders = list(layer.quant_orders.values())

        def same(a, b):
            return (a is None and b is None) or (a is not None and b is not None and all(
                (x is None and y is None) or (x is not None and y is not None
                                              and torch.equal(x, y)) for x, y in zip(a, b)))

        if layer.shard_orders is None and all(same(o, orders[0]) for o in orders):
            layer.perm, layer.g_idx = orders[0] if orders[0] is not None else (None, None)
            return
        layer.perm = layer.g_idx = None
        shards = range(len(layer.output_sizes)) if None not in layer.quant_orders else [None]
        layer.shard_orders = [(*layer.shard_offset(s), *(layer.quant_orders.get(s) or
                                                          (None, None))) for s in shards]

    # ---- dummy weights and the matmul -----------------------------------------------------------

    def load_dummy_weights(self, layer: LinearBase, generator: torch.Generator) -> None:
        """Random packed fields (every value equally likely), zero points at the middle of the
        range and scales that give weights of std ~0.02, made on the layer's device."""
        q = layer.qweight
        q.copy_(torch.randint(-2**31, 2**31 - 1, q.shape, generator=generator,
                              dtype=torch.int32, device=q.device))
        layer.zeros.fill_(2 ** (self.bits - 1))
        std_q = (2**self.bits) / 12**0.5
        layer.scales.normal_(0.02 / std_q, 0.002 / std_q, generator=generator)
        if layer.bias is not None:
            layer.bias.data.normal_(0.0, 0.02, generator=generator)

    def _parts(self, layer: LinearBase):
        """(qweight, scales, zeros, perm, g_idx) of each product the layer runs: the whole
        layer, or each shard's columns under ``shard_orders``."""
        if layer.shard_orders is None:
            return [(layer.qweight, layer.scales, layer.zeros, layer.perm, layer.g_idx)]
        return [(layer.qweight[:, start:start + size], layer.scales[:, start:start + size],
                 layer.zeros[:, start:start + size], perm, g_idx)
                for start, size, perm, g_idx in layer.shard_orders]

    def dequantized_weight(self, layer: LinearBase) -> Tensor:
        """W ``[N, K]`` in the model dtype, input channels in the checkpoint's order."""
        cols = []
        for qweight, scales, zeros, perm, g_idx in self._parts(layer):
            wt = dequantize_canonical(qweight, scales, zeros, self.bits, layer.wgroup_size,
                                      g_idx)
            if perm is not None:
                wt = torch.empty_like(wt).index_copy_(0, perm, wt)
            cols.append(wt)
        return torch.cat(cols, dim=1).t()

    def apply_silu_mul(self, layer: LinearBase, x):
        """The CUDA-core GEMV's gated epilogue where the product's config is the GEMV (decode
        sizes, no g_idx, no bias)."""
        if not x.is_cuda or x.dim() != 2 or layer.bias is not None or layer.g_idx is not None \
                or layer.shard_orders is not None:
            return None
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        return _kernel_module().wna16_matmul_silu_mul(x, layer.qweight, layer.scales,
                                                      layer.zeros, self.bits,
                                                      layer.wgroup_size)

    def apply(self, layer: LinearBase, x):
        if layer.shard_orders is None:  # the fast path: one product
            out = self._product(layer, x, layer.qweight, layer.scales, layer.zeros, layer.perm,
                                layer.g_idx)
        else:  # shards with their own act-order: one gather and one product each
            out = torch.cat([self._product(layer, x, *part) for part in self._parts(layer)],
                            dim=-1)
        if layer.bias is not None:
            out = out + layer.bias
        return out

    def _product(self, layer: LinearBase, x, qweight, scales, zeros, perm, g_idx):
        """``x[..., perm] @ W^T`` for canonical tensors (or a shard's column slices of them)."""
        if perm is not None:
            x = x.index_select(-1, perm)
        if x.is_cuda:
            return _kernel_module().wna16_matmul(x, qweight, scales, zeros, self.bits,
                                                 layer.wgroup_size, g_idx)
        wt = dequantize_canonical(qweight, scales, zeros, self.bits, layer.wgroup_size, g_idx)
        return x @ wt.to(x.dtype)
