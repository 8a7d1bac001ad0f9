"""A transformers decoder layer as the quantizer sees it: which linears it has, in which order
AutoGPTQ quantizes them, which groups AutoAWQ scales together, and how to run its parts on the
calibration activations.

Supported: the Llama family of ``model_type`` (llama, mistral, qwen2, qwen3): ``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ScaleGroup:
    """One AWQ scaling group (AutoAWQ's ``get_layers_for_scaling`` entry).

    prev_op: the module whose output feeds ``linears`` and absorbs ``1/s`` (an RMSNorm or the
    previous linear); linears: scaled by ``s`` on their input channels; inspect: the module whose
    output the search compares (None: the single linear itself).
    """

    prev_op: str
    linears: tuple[str, ...]
    inspect: str | None = None


@dataclass(frozen=True)
class DecoderLayout:
    sequential: tuple[tuple[str, ...], ...]  # AutoGPTQ's inside_layer_modules (true sequential)
    awq_groups: tuple[ScaleGroup, ...]
    no_clip: tuple[str, ...]  # AutoAWQ skips the clip search where q.k makes it imprecise

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(n for group in self.sequential for n in group)


LLAMA = DecoderLayout(
    sequential=(("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"),
                ("self_attn.o_proj",),
                ("mlp.up_proj", "mlp.gate_proj"),
                ("mlp.down_proj",)),
    awq_groups=(
        ScaleGroup("input_layernorm",
                   ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        # only where v and o have the same shape (no GQA): llm-awq PR 67
        ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",)),
        ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScaleGroup("mlp.up_proj", ("mlp.down_proj",)),
    ),
    no_clip=("self_attn.q_proj", "self_attn.k_proj"),
)

LAYOUTS = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA}


def layout_for(model_type: str) -> DecoderLayout:
    """Raises ValueError for a model type the quantizer does not know."""
    if model_type not in LAYOUTS:
        raise ValueError(f"quantize: model_type {model_type!r} is not supported "
                         f"(supported: {sorted(LAYOUTS)})")
    return LAYOUTS[model_type]


def linear(layer: nn.Module, name: str) -> nn.Linear:
    return layer.get_submodule(name)


def slice_batch(value: Any, sl: slice, n: int) -> Any:
    """The samples ``sl`` of layer kwargs made for a batch of ``n`` samples: tensors (also in
    tuples and dicts) with a leading dimension of n are sliced, the rest (broadcast) kept."""
    if isinstance(value, torch.Tensor):
        return value[sl] if value.dim() > 0 and value.shape[0] == n and n > 1 else value
    if isinstance(value, tuple):
        return tuple(slice_batch(v, sl, n) for v in value)
    if isinstance(value, dict):
        return {k: slice_batch(v, sl, n) for k, v in value.items()}
    return value


def _accepted(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs the module's forward takes (all of them if it takes **kwargs)."""
    params = inspect.signature(module.forward).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


@torch.no_grad()
def run(module: nn.Module, x: torch.Tensor, kwargs: dict[str, Any],
        max_tokens: int = 4096) -> torch.Tensor:
    """``module(x, **kwargs)`` over ``x: [n_samples, seq_len, hidden]`` in chunks of samples of
    at most ``max_tokens`` tokens; a tuple output gives its first element."""
    kw = _accepted(module, kwargs)
    n, seq_len = x.shape[:2]
    step = max(1, max_tokens // seq_len)
    outs = []
    for i in range(0, n, step):
        sl = slice(i, i + step)
        out = module(x[sl], **slice_batch(kw, sl, n))
        outs.append(out[0] if isinstance(out, tuple) else out)
    return torch.cat(outs, dim=0)


@torch.no_grad()
def capture_inputs(layer: nn.Module, names: list[str] | tuple[str, ...], x: torch.Tensor,
                   kwargs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Run the decoder layer on ``x: [n, seq_len, hidden]`` -> (inputs of each linear in
    ``names``: [n * seq_len, in_features], the layer's output [n, seq_len, hidden])."""
    feats: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [linear(layer, n).register_forward_hook(
        lambda m, inp, out, n=n: feats[n].append(inp[0].reshape(-1, inp[0].shape[-1])))
        for n in names]
    try:
        out = run(layer, x, kwargs)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v, dim=0) for n, v in feats.items()}, out
