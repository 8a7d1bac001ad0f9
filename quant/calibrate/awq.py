"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"), as llm-awq / AutoAWQ's ``AwqQuantizer`` runs it.

Input channels that see large activations matter most. Per scaling group (the linears that read
one op's output), AWQ searches per-input-channel scales ``s = x_mean^a / w_mean^(1-a)``
("duo scaling"; ``a`` on a grid of 20) that minimise the error of the block output when the
weights are quantized as ``Q(W * s) / s``; ``1/s`` is folded into the op before (RMSNorm weight or
the previous linear's rows), ``s`` into the weights. Then a clipping search shrinks each group's
max to minimise the linear's output error, and the scaled, clipped weights are rounded to nearest.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import DecoderLayout, capture_inputs, linear, run, slice_batch
from .rtn import QuantGrid, QuantizedWeight


def _weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """[in]: mean over output rows of |w| normalised by its group's max (AutoAWQ's w_mean)."""
    w = torch.cat([t.float() for t in weights], dim=0)
    gs = w.shape[1] if group_size == -1 else group_size
    g = w.abs().reshape(-1, gs)
    g = g / (g.amax(dim=1, keepdim=True) + 1e-6)
    return g.reshape(w.shape).mean(0)


@torch.no_grad()
def search_scale(x: torch.Tensor, weights: list[torch.Tensor],
                 block_forward: Callable[[list[torch.Tensor] | None], torch.Tensor],
                 grid: QuantGrid, n_grid: int = 20, duo_scaling: bool = True) -> torch.Tensor:
    """Best per-input-channel scales for a group of linears.

    x: [tokens, in] their common input; weights: each [out_i, in]; block_forward(ws) runs the
    inspected block with the linears' weights replaced by ``ws`` (None: the originals) and returns
    its output. Candidates are s = 1 (plain rounding, llm-awq's a = 0) and the AutoAWQ grid;
    returns the s: [in] float32 with the lowest output MSE.
    """
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)
    w_mean = _weight_mean(weights, grid.group_size)
    ref = block_forward(None).float()
    candidates = [torch.ones_like(x_mean)]
    for r in range(n_grid):
        a = r / n_grid
        if duo_scaling:
            s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(a).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s[~torch.isfinite(s)] = 1
        candidates.append(s)
    best, best_err = candidates[0], float("inf")
    for s in candidates:
        qw = [grid.fake(w.float() * s) / s for w in weights]
        err = (block_forward([q.to(w.dtype) for q, w in zip(qw, weights)]).float() - ref)
        err = err.pow(2).mean().item()
        if err < best_err:
            best, best_err = s, err
    return best


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, grid: QuantGrid, n_grid: int = 20,
                max_shrink: float = 0.5, n_tokens: int = 512,
                rows_per_chunk: int = 1024) -> torch.Tensor:
    """Per-group clipping threshold of ``w: [out, in]`` given its inputs ``x: [tokens, in]``
    (AutoAWQ's ``_compute_best_clip``): the shrink of the group's absmax, in steps of 1/n_grid
    down to ``1 - max_shrink``, with the lowest error on the group's partial outputs.
    Returns max_val: [out, n_groups] float32."""
    out, n_in = w.shape
    gs = n_in if grid.group_size == -1 else grid.group_size
    ng = n_in // gs
    x = x.reshape(-1, n_in).float()
    x = x[::max(1, x.shape[0] // n_tokens)]
    xg = x.reshape(-1, ng, gs).permute(1, 0, 2)  # [ng, T, gs]
    best_all = []
    for r0 in range(0, out, rows_per_chunk):
        wc = w[r0:r0 + rows_per_chunk].float().reshape(-1, ng, gs)  # [oc, ng, gs]
        org = torch.bmm(xg, wc.permute(1, 2, 0))  # [ng, T, oc]
        org_max = wc.abs().amax(dim=-1)  # [oc, ng]
        best_max = org_max.clone()
        best_err = torch.full_like(org_max, float("inf"))
        for i in range(int(max_shrink * n_grid)):
            mv = (org_max * (1 - i / n_grid)).unsqueeze(-1)
            cur = torch.clamp(wc, -mv, mv).reshape(wc.shape[0], n_in)
            q = grid.fake(cur).reshape(-1, ng, gs)
            err = (torch.bmm(xg, q.permute(1, 2, 0)) - org).pow(2).mean(dim=1).t()  # [oc, ng]
            better = err < best_err
            best_err[better] = err[better]
            best_max[better] = mv.squeeze(-1)[better]
        best_all.append(best_max)
    return torch.cat(best_all, dim=0)


def clip(w: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """Clamp ``w: [out, in]`` per group to ``[-max_val, max_val]`` (max_val: [out, n_groups])."""
    out, n_in = w.shape
    g = w.reshape(out, max_val.shape[1], -1)
    mv = max_val.unsqueeze(-1).to(w.dtype)
    return torch.clamp(g, -mv, mv).reshape(out, n_in)


@torch.no_grad()
def fold_scale(prev_op: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Apply ``s: [in]``: the linears' input channels times s, the previous op's output
    channels divided by s (AutoAWQ's ``scale_ln_fcs`` / ``scale_fc_fc``)."""
    if isinstance(prev_op, nn.Linear):
        prev_op.weight[-s.numel():].div_(s.view(-1, 1).to(prev_op.weight.dtype))
    else:  # an RMSNorm / LayerNorm
        prev_op.weight.div_(s.to(prev_op.weight.dtype))
    if getattr(prev_op, "bias", None) is not None:
        prev_op.bias[-s.numel():].div_(s.to(prev_op.bias.dtype))
    for lin in linears:
        lin.weight.mul_(s.view(1, -1).to(lin.weight.dtype))


def _block_forward(layer: nn.Module, lins: list[nn.Linear], inspect_name: str | None,
                   x3: torch.Tensor, kwargs: dict[str, Any]):
    """block_forward for `search_scale`: x3 [n, seq_len, in] the linears' input."""
    module = layer.get_submodule(inspect_name) if inspect_name else None
    x = x3.reshape(-1, x3.shape[-1])

    def forward(ws: list[torch.Tensor] | None) -> torch.Tensor:
        if module is None:
            lin = lins[0]
            return F.linear(x, lin.weight if ws is None else ws[0], lin.bias)
        if ws is None:
            return run(module, x3, kwargs)
        saved = [lin.weight.data for lin in lins]
        try:
            for lin, w in zip(lins, ws):
                lin.weight.data = w
            return run(module, x3, kwargs)
        finally:
            for lin, w in zip(lins, saved):
                lin.weight.data = w
    return forward


@torch.no_grad()
def awq_layer(layer: nn.Module, layout: DecoderLayout, x: torch.Tensor,
              kwargs: dict[str, Any], grid: QuantGrid, clip_search: bool = True,
              search_tokens: int = 1024) -> dict[str, QuantizedWeight]:
    """AWQ one decoder layer in place: scales folded, weights clipped and replaced by their
    dequantized values. x: [n_samples, seq_len, hidden] the layer's input. The activation
    statistics use every token; the output error of each scale candidate is measured on the
    first samples up to ``search_tokens`` tokens (21 block forwards per group: the CPU cost).
    Returns the neutral form of every linear, by name within the layer."""
    feats, _ = capture_inputs(layer, layout.linears, x, kwargs)
    n_search = max(1, search_tokens // x.shape[1])
    search_kwargs = slice_batch(kwargs, slice(0, n_search), x.shape[0])
    found = []
    for g in layout.awq_groups:
        lins = [linear(layer, n) for n in g.linears]
        prev = layer.get_submodule(g.prev_op)
        if isinstance(prev, nn.Linear) and prev.out_features != lins[0].in_features:
            continue  # e.g. v_proj -> o_proj under grouped-query attention
        x3 = feats[g.linears[0]].reshape(*x.shape[:2], -1)[:n_search]
        fwd = _block_forward(layer, lins, g.inspect, x3, search_kwargs)
        s = search_scale(feats[g.linears[0]], [lin.weight for lin in lins], fwd, grid)
        found.append((g, prev, lins, s))
    for g, prev, lins, s in found:  # all searched on the unscaled layer, as AutoAWQ
        fold_scale(prev, lins, s)
        for n in g.linears:
            feats[n] = feats[n] / s.to(feats[n].dtype)
    result = {}
    for name in layout.linears:
        lin = linear(layer, name)
        if clip_search and name not in layout.no_clip:
            lin.weight.data = clip(lin.weight.data, search_clip(lin.weight, feats[name], grid))
        qw = grid.quantize(lin.weight)
        lin.weight.data = qw.dequantize().to(lin.weight.dtype)
        result[name] = qw
    return result
