"""The attention layer models build from: writes new K/V into the paged cache, then attends.

The backend (a plugin) does the work; the layer only holds the head geometry.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D]; kv_cache: this layer's cache. Returns [T, Hq * D]."""
        self.backend.write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = self.backend.forward(q, kv_cache, metadata, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
