"""Loading a Hugging Face checkpoint into a `DecoderForCausalLM` (core/layers/decoder.py), by
tensor name, on one pipeline stage and tensor-parallel rank.

Each name is mapped to this stage's module (``DecoderForCausalLM.stage_key``: another stage's
tensors are skipped), then loaded by the layer that owns it: merged layers (fused QKV, gate/up)
take their checkpoint shards through the model's ``stacked`` table, linear layers through their
quant method (which cuts this rank's part, core/layers/linear.py), vocabulary tables through
their ``weight_loader`` (core/layers/vocab.py), and anything else is copied whole. Every linear
layer is then repacked once (``QuantMethod.process_weights_after_loading``), and so is a 16-bit
LM head (``LMHead.process_weights_after_loading``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from .linear import LinearBase
from .vocab import LMHead

if TYPE_CHECKING:
    from .decoder import DecoderForCausalLM


def load_checkpoint(model: "DecoderForCausalLM",
                    weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load (Hugging Face name, tensor in the model dtype) pairs into ``model``; returns the
    names loaded (another stage's are not). Raises ValueError for a tensor the model has no
    place for, or a shape mismatch, and for a linear layer its quant method cannot finish
    (e.g. a tensor missing: the message names the checkpoint's layer)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    stacked = model.stacked
    loaded = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        key = model.stage_key(name.removeprefix("model."))
        if key is None:  # another pipeline stage's tensor
            continue
        parts = key.rsplit(".", 2)  # [..., module, param]
        if len(parts) == 3 and parts[1] in stacked:
            target, shard = stacked[parts[1]]
            modules[f"{parts[0]}.{target}"].load(parts[2], tensor, shard)
        elif len(parts) >= 2 and isinstance(modules.get(key.rsplit(".", 1)[0]), LinearBase):
            mod, pname = key.rsplit(".", 1)
            modules[mod].load(pname, tensor, None)
        elif key in params:
            p = params[key]
            loader = getattr(p, "weight_loader", None)  # vocab-parallel tables
            if loader is not None:
                loader(tensor)
            elif p.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not "
                                 f"match the model's {tuple(p.shape)}")
            else:
                p.data.copy_(tensor)
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no place in "
                             f"{type(model).__name__}")
        if key == "embed_tokens.weight" and isinstance(model.lm_head, LinearBase) and (
                model.head_from_embedding()):
            model.lm_head.load("weight", tensor)  # a quantized copy of the tied table
        loaded.add(name)
    for path, mod in modules.items():
        if isinstance(mod, LMHead):
            mod.process_weights_after_loading()
        elif isinstance(mod, LinearBase):
            try:
                mod.quant_method.process_weights_after_loading(mod)
            except ValueError as e:  # e.g. a tensor missing: name the layer
                if type(e) is not ValueError:  # ConfigError & co. keep their type
                    raise
                raise ValueError(f"{model.checkpoint_module(path)}: {e}") from e
    return loaded
