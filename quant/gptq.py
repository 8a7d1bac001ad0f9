"""``gptq``: AutoGPTQ / GPTQModel checkpoints (4- or 8-bit weights, 16-bit activations).

Checkpoint tensors per linear layer (layout in quant/packing.py): ``qweight`` int32
``[in*bits/32, out]`` packed along the input dimension, ``qzeros`` int32 ``[G, out*bits/32]``,
``scales`` ``[G, out]``, ``g_idx`` int32 ``[in]``, optional ``bias``. Read from config.json
``quantization_config`` or quantize_config.json: ``bits`` (4, 8), ``group_size`` (-1 or a
divisor of each input size), ``desc_act`` (act-order: ``g_idx`` in any order; the input channels
are sorted by group once at load), ``sym``, ``checkpoint_format`` / ``format`` (``gptq``: v1,
qzeros store zero - 1; ``gptq_v2``: stored as is), ``lm_head`` (GPTQModel: the LM head is
quantized too, ``lm_head.qweight`` ...; the engine builds it with this method).

A 16-bit checkpoint with ``quantization: gptq`` is rounded to nearest at load (4 bits, symmetric,
group size 128, or the largest of 64, 32 that divides every layer, else one group).
"""

from __future__ import annotations

from pagebatch.hookspecs import hookimpl
from pagebatch.layers.linear import LinearBase

from .common import ConfigError, check_allowed, config_field, shape_error
from .packing import GPTQ_FORMATS, unpack_gptq
from .wna16 import WNA16Method


class GPTQMethod(WNA16Method):
    name = "gptq"
    checkpoint_names = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config=None, hf_quant_config=None):
        super().__init__(config, hf_quant_config)
        hf = hf_quant_config
        self.from_checkpoint = bool(hf)
        self.bits = int(config_field(hf, ("bits", "w_bit"), 4))
        check_allowed("gptq", "bits", self.bits, (4, 8))
        self.group_size = int(config_field(hf, ("group_size",), 128))
        if self.group_size != -1 and self.group_size <= 0:
            raise ConfigError(f"quantization 'gptq': quantization_config.group_size="
                              f"{self.group_size} is not supported (-1 or a positive divisor "
                              f"of the input size)")
        self.desc_act = bool(config_field(hf, ("desc_act",), False))
        self.sym = bool(config_field(hf, ("sym",), True))
        self.checkpoint_format = str(config_field(hf, ("checkpoint_format", "format"), "gptq"))
        field = "checkpoint_format" if hf and "checkpoint_format" in hf else "format"
        check_allowed("gptq", field, self.checkpoint_format, GPTQ_FORMATS)
        self.checkpoint_lm_head = bool(config_field(hf, ("lm_head",), False))

    def layer_group_size(self, k):
        if not self.from_checkpoint and k % self.group_size:
            return next((g for g in (64, 32) if k % g == 0), k)
        return super().layer_group_size(k)

    def whole_groups(self, layer):
        return self.desc_act and layer.parallel == "row"

    def cut(self, layer, name, tensor, shard):
        pf = 32 // self.bits
        if name == "g_idx":  # [in]
            return layer.shard_checkpoint_tensor(tensor, shard, input_dim=0)
        if name == "qweight":  # [in*bits/32, out]
            return layer.shard_checkpoint_tensor(tensor, shard, input_dim=0, input_pack=pf,
                                                 output_dim=1)
        # qzeros [G, out*bits/32], scales [G, out]: every group stays on every rank under
        # act-order row parallelism
        in_dim = None if self.whole_groups(layer) else 0
        return layer.shard_checkpoint_tensor(tensor, shard, input_dim=in_dim,
                                             input_pack=layer.wgroup_size, output_dim=1,
                                             output_pack=pf if name == "qzeros" else 1)

    def required_names(self):
        names = {"qweight", "qzeros", "scales"}
        return names | {"g_idx"} if self.desc_act else names

    def unpack_shard(self, layer: LinearBase, shard, tensors):
        _, size = layer.shard_offset(shard)
        k, g, pf = layer.input_size, layer.scales.shape[0], 32 // self.bits
        if size % pf:
            raise ValueError(f"gptq: output shard {shard} of size {size} is not a multiple of "
                             f"{pf}")
        want = {"qweight": (k // pf, size), "qzeros": (g, size // pf), "scales": (g, size),
                "g_idx": (k,)}
        for name, t in tensors.items():
            if tuple(t.shape) != want[name]:
                raise shape_error("gptq", name, t.shape, want[name], shard)
        g_idx = tensors.get("g_idx")
        q, z, s, gi = unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"],
                                  g_idx, self.bits, layer.wgroup_size, self.checkpoint_format)
        return q, z, s, (gi if g_idx is not None else None)


@hookimpl
def register_quant_methods(register):
    register("gptq", GPTQMethod)
