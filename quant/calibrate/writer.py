"""Write a quantized checkpoint folder in the public layouts other tools load.

- ``awq``: AutoAWQ "GEMM" tensors (qweight, qzeros, scales) and config.json
  ``quantization_config`` exactly as AutoAWQ's ``AwqConfig.to_transformers_dict`` writes it.
- ``gptq``: AutoGPTQ tensors (qweight, qzeros, scales, g_idx) in checkpoint_format "gptq" (v1:
  zero points stored minus one), ``quantization_config`` and quantize_config.json as AutoGPTQ's
  ``BaseQuantizeConfig.to_dict``; ``--lm-head`` quantizes ``lm_head`` too and adds GPTQModel's
  ``"lm_head": true``.
- ``int8``: int8 ``weight`` with fp32 per-output-channel ``weight_scale``, what the ``int8``
  quant method (quant/int8.py) loads.

Everything that is not a quantized linear weight is written in fp16 (as AutoAWQ and AutoGPTQ
do), config.json through transformers, and the tokenizer files are copied.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagebatch.quant.packing import pack_awq, pack_gptq

from .rtn import QuantizedWeight

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
DTYPE = torch.float16


def awq_quantization_config(bits: int, group_size: int, zero_point: bool) -> dict[str, Any]:
    """AutoAWQ's ``AwqConfig.to_transformers_dict`` for the GEMM version."""
    return {"quant_method": "awq", "zero_point": zero_point, "group_size": group_size,
            "bits": bits, "version": "gemm", "modules_to_not_convert": None}


def gptq_quantization_config(bits: int, group_size: int, sym: bool, desc_act: bool,
                             damp_percent: float, out_dir: Path,
                             lm_head: bool = False) -> dict[str, Any]:
    """AutoGPTQ's ``BaseQuantizeConfig.to_dict`` (quantize_config.json and config.json); with
    ``lm_head`` also GPTQModel's ``"lm_head": true`` (the LM head's tensors are quantized)."""
    config = {"bits": bits, "group_size": group_size, "damp_percent": damp_percent,
              "desc_act": desc_act, "static_groups": False, "sym": sym, "true_sequential": True,
              "model_name_or_path": str(out_dir), "model_file_base_name": "model",
              "quant_method": "gptq", "checkpoint_format": "gptq"}
    return {**config, "lm_head": True} if lm_head else config


def int8_quantization_config() -> dict[str, Any]:
    return {"quant_method": "int8", "bits": 8, "activation_scheme": "dynamic"}


class CheckpointWriter:
    """Collects packed tensors layer by layer, then writes the folder in ``finish``.

    quantization_config: the dict for config.json (see the ``*_quantization_config`` helpers).
    """

    def __init__(self, out_dir: Path, quantization_config: dict[str, Any]):
        self.out_dir = Path(out_dir)
        self.qconfig = quantization_config
        self.method = quantization_config["quant_method"]
        self.tensors: dict[str, torch.Tensor] = {}
        self.quantized: set[str] = set()  # module names whose .weight is replaced

    def add(self, module_name: str, qw: QuantizedWeight) -> None:
        """Pack one linear's neutral form (AWQ or GPTQ layout per the config)."""
        scales = qw.scales.to(DTYPE)
        if self.method == "awq":
            packed = pack_awq(qw.intweight, qw.zeros, scales, qw.group_size)
            if not self.qconfig["zero_point"]:
                del packed["qzeros"]  # zero_point false: an implied zero of 8
        else:
            packed = pack_gptq(qw.intweight, qw.zeros, scales, qw.g_idx, qw.bits, qw.group_size,
                               self.qconfig["checkpoint_format"])
        for k, v in packed.items():
            self.tensors[f"{module_name}.{k}"] = v.cpu()
        self.quantized.add(module_name)

    def add_int8(self, module_name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        """q: [out, in] int8, scale: [out] fp32."""
        self.tensors[f"{module_name}.weight"] = q.cpu().contiguous()
        self.tensors[f"{module_name}.weight_scale"] = scale.float().cpu().contiguous()
        self.quantized.add(module_name)

    def finish(self, model: nn.Module, source: Path) -> Path:
        """Write model.safetensors (the packed tensors plus ``model``'s other tensors in fp16),
        config.json, quantize_config.json (GPTQ) and the tokenizer files of ``source``."""
        from safetensors.torch import save_file

        self.out_dir.mkdir(parents=True, exist_ok=True)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        tensors = dict(self.tensors)
        for name, t in model.state_dict().items():
            module = name.rpartition(".")[0]
            if module in self.quantized and name.endswith(".weight"):
                continue
            if tied and name == "lm_head.weight":
                continue
            tensors[name] = (t.to(DTYPE) if t.is_floating_point() else t).cpu().contiguous()
        save_file(tensors, str(self.out_dir / "model.safetensors"), metadata={"format": "pt"})

        config = copy.deepcopy(model.config)
        config.quantization_config = self.qconfig
        config.dtype = DTYPE
        config.save_pretrained(self.out_dir)
        if self.method == "gptq":
            (self.out_dir / "quantize_config.json").write_text(json.dumps(self.qconfig, indent=2))
        for f in TOKENIZER_FILES:
            if (Path(source) / f).is_file():
                shutil.copy2(Path(source) / f, self.out_dir / f)
        return self.out_dir
