"""The attention layer models build from: writes new K/V into the paged cache, then attends.

The backend (a plugin) does the work; the layer only holds the head geometry and, for an fp8
KV cache, its scalar ``k_scale`` / ``v_scale`` (core/attention.py has the format).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..attention import FP8_KV_DTYPE, AttentionBackend, AttentionMetadata
from ..errors import ConfigError


# set by core/piecewise_graphs.py while it captures: called in place of each attention, it ends
# the graph piece so far and returns the static tensor the next piece reads
_split: Callable | None = None


def set_split(fn: Callable | None) -> None:
    """Route every `Attention.forward` to ``fn(layer, q, k, v, kv_cache, rope)`` (None: back
    to attending). Only core/piecewise_graphs.py's capture sets it."""
    global _split
    _split = fn


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        # fp8 KV cache scales (vLLM's defaults without calibration); fixed once weights are
        # loaded: CUDA graphs capture them
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.sliding_window: int | None = None  # tokens; None: full causal attention
        # the layer's KV cache group (core/kv_hybrid.py): it reads metadata.kv_groups[kv_group]
        self.kv_group = 0

    def set_sliding_window(self, window: int | None) -> None:
        """Attend over the last ``window`` tokens (a token at position i sees keys j with
        i - window < j <= i), or fully (None). Raises ConfigError when the backend has no
        sliding window (``supports_sliding_window``)."""
        if window is not None and not self.backend.supports_sliding_window:
            raise ConfigError(f"the model attends over a sliding window of {window} tokens; "
                              f"the {self.backend.name!r} attention backend has none")
        self.sliding_window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, rope: tuple | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D]; kv_cache: this layer's cache. Returns [T, Hq * D].
        ``rope``: (positions [T] int64, a `RotaryEmbedding`) to apply to q and k first: inside
        the backend's KV write and attention when it supports that (``supports_fused_rope``:
        one kernel fewer per layer), else here. While core/piecewise_graphs.py captures, the
        call ends the current graph piece instead (`set_split`)."""
        if _split is not None:
            return _split(self, q, k, v, kv_cache, rope)
        return self.attend(q, k, v, kv_cache, metadata, rope)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata, rope: tuple | None = None) -> torch.Tensor:
        """`forward`'s work: write the new K/V, attend (never captured in a piece)."""
        if self.kv_group and metadata.kv_groups is not None:
            metadata = metadata.kv_groups[self.kv_group]
        kw = {}
        if kv_cache.dtype == FP8_KV_DTYPE:  # only backends with supports_fp8_kv_cache get one
            kw = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if rope is not None:
            positions, rotary = rope
            if self.backend.supports_fused_rope:
                kw["rope"] = (positions, rotary.cos_sin)
            else:
                q, k = rotary(positions, q, k)
        self.backend.write_kv(k, v, kv_cache, metadata.slot_mapping, **kw)
        if self.backend.accepts_new_kv:
            kw["new_kv"] = (k, v)
        if self.sliding_window is not None:
            kw["sliding_window"] = self.sliding_window
        out = self.backend.forward(q, kv_cache, metadata, self.scale, **kw)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
