"""``awq``: AutoAWQ "GEMM" checkpoints (4-bit weights, fp16 scales, 16-bit activations).

Checkpoint tensors per linear layer (layout in quant/packing.py): ``qweight`` int32
``[in, out/8]`` packed along the output dimension in AWQ's interleaved nibble order, ``qzeros``
int32 ``[in/group, out/8]``, ``scales`` ``[in/group, out]``, optional ``bias``. Read from
config.json ``quantization_config`` (``quant_method: awq``, ``bits``, ``group_size``,
``zero_point``, ``version``) or quant_config.json (``w_bit``, ``q_group_size``).
``zero_point: false``: no qzeros, unsigned nibbles with an implied zero of 8.

Unpacked once at load and repacked into the layout of quant/wna16.py. A 16-bit checkpoint with
``quantization: awq`` is rounded to nearest at load (group size 128, or the largest of 64, 32
that divides every layer, else one group).
"""

from __future__ import annotations

from pagebatch.hookspecs import hookimpl
from pagebatch.layers.linear import LinearBase

from .common import ConfigError, check_allowed, config_field, shape_error
from .packing import unpack_awq
from .wna16 import WNA16Method


class AWQMethod(WNA16Method):
    name = "awq"
    bits = 4
    checkpoint_names = ("qweight", "qzeros", "scales")

    def __init__(self, config=None, hf_quant_config=None):
        super().__init__(config, hf_quant_config)
        hf = hf_quant_config
        self.from_checkpoint = bool(hf)
        check_allowed("awq", "bits", int(config_field(hf, ("bits", "w_bit"), 4)), (4,))
        version = str(config_field(hf, ("version",), "gemm")).lower()
        check_allowed("awq", "version", version, ("gemm",))
        self.group_size = int(config_field(hf, ("group_size", "q_group_size"), 128))
        if self.group_size != -1 and self.group_size <= 0:
            raise ConfigError(f"quantization 'awq': quantization_config.group_size="
                              f"{self.group_size} is not supported (-1 or a positive divisor "
                              f"of the input size)")
        self.has_zeros = bool(config_field(hf, ("zero_point",), True))
        self.sym = not self.has_zeros
        skip = config_field(hf, ("modules_to_not_convert",), None)
        if skip:
            check_allowed("awq", "modules_to_not_convert", skip, (None, []))

    def layer_group_size(self, k):
        if not self.from_checkpoint and k % self.group_size:
            return next((g for g in (64, 32) if k % g == 0), k)
        return super().layer_group_size(k)

    def cut(self, layer, name, tensor, shard):
        gs = layer.wgroup_size
        in_pack = 1 if name == "qweight" else gs  # qweight [in, out/8]; qzeros/scales [in/g, .]
        out_pack = 1 if name == "scales" else 8
        return layer.shard_checkpoint_tensor(tensor, shard, input_dim=0, input_pack=in_pack,
                                             output_dim=1, output_pack=out_pack)

    def required_names(self):
        return {"qweight", "qzeros", "scales"} if self.has_zeros else {"qweight", "scales"}

    def unpack_shard(self, layer: LinearBase, shard, tensors):
        _, size = layer.shard_offset(shard)
        k, g = layer.input_size, layer.scales.shape[0]
        want = {"qweight": (k, size // 8), "qzeros": (g, size // 8), "scales": (g, size)}
        if size % 8:
            raise ValueError(f"awq: output shard {shard} of size {size} is not a multiple of 8")
        for name, t in tensors.items():
            if tuple(t.shape) != want[name]:
                raise shape_error("awq", name, t.shape, want[name], shard)
        qzeros = tensors.get("qzeros") if self.has_zeros else None
        q, z, s = unpack_awq(tensors["qweight"], qzeros, tensors["scales"], layer.wgroup_size)
        return q, z, s, None


@hookimpl
def register_quant_methods(register):
    register("awq", AWQMethod)
