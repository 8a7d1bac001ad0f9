"""The batched sampler: greedy, temperature, top-k and top-p, on the logits' device.

Random draws use a counter-based generator keyed on (request seed, token position, vocab index):
the SplitMix64 finalizer (Steele et al., "Fast splittable pseudorandom number generators",
OOPSLA 2014) over 64-bit integer tensors. A seeded request therefore samples the same tokens
alone or in any batch, and there is no generator state to carry (graph-capturable). Sampling is
Gumbel-max: ``argmax(logits / T - log(-log u))`` equals a draw from ``softmax(logits / T)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import GREEDY_EPS


def _u64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _u64(0x9E3779B97F4A7C15)
_M1 = _u64(0xBF58476D1CE4E5B9)
_M2 = _u64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1): [n, vocab] fp32, a pure function of (seed, position, column).

    seeds, positions: [n] int64 on the target device.
    """
    col = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    z = (seeds[:, None] * _GOLDEN + positions[:, None]) * _M1 + col[None, :] * _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    bits = _shr(z, 40)  # top 24 bits
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device.

    temperature: [n] fp32 (0 = greedy); top_k: [n] int64 (0 = off); top_p: [n] fp32;
    seeds, positions: [n] int64 (position = index of the token being sampled).
    all_greedy / any_top_k / any_top_p: host flags that pick the fast paths.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits: [n, vocab] fp32 -> token ids [n] int64."""
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy
        is_greedy = batch.temperature < GREEDY_EPS
        temp = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
        x = logits / temp[:, None]
        if batch.any_top_k or batch.any_top_p:
            x = apply_top_k_top_p(x, batch.top_k if batch.any_top_k else None,
                                  batch.top_p if batch.any_top_p else None)
        u = counter_uniform(batch.seeds, batch.positions, x.shape[-1])
        gumbel = -torch.log(-torch.log(u))
        sampled = (x + gumbel).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) to -inf. x: [n, vocab] fp32.

    top_k: [n] int64, 0 or >= vocab = off; top_p: [n] fp32, 1.0 = off. One sort, only when asked.
    """
    vocab = x.shape[-1]
    sorted_x, idx = x.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
        keep &= torch.arange(vocab, device=x.device)[None, :] < k[:, None]
    if top_p is not None:
        probs = sorted_x.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        keep &= before < top_p[:, None]
    keep[:, 0] = True
    mask = torch.empty_like(keep).scatter_(1, idx, keep)
    return x.masked_fill(~mask, float("-inf"))
