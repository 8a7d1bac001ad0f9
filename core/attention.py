"""The attention backend interface and the metadata that describes one step's batch.

A step's batch is flattened: the new tokens of every scheduled request, request after request,
``num_tokens`` in all. Request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]`` and,
after this step, ``seq_lens[i]`` tokens of context in the paged KV cache, read through row ``i``
of ``block_tables``. Prefill chunks and decodes (one row) mix freely.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout. Tensors live on the model's device.

    slot_mapping:    [num_tokens] int64, cache slot (block_id * block_size + offset) per new token
    query_start_loc: [num_seqs + 1] int32, prefix sums of new tokens per request
    seq_lens:        [num_seqs] int32, context length of each request after this step
    block_tables:    [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len, max_seq_len: Python ints (kernel launch sizes)
    query_start_loc_cpu, seq_lens_cpu: the same as lists, for backends that loop on the host
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Reads and writes the paged KV cache. Plugins implement this.

    Layout: ``kv_cache_shape`` gives the shape of one layer's cache tensor; the default is
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V). The cache is allocated
    uninitialized: slots past a request's ``seq_len`` (and padding entries of block tables) may
    hold anything, NaN included, and must never reach the output.
    """

    name: str = "?"

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when usable on this device and dtype, else a reason."""
        return None

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store new K/V. key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping:
        [num_tokens] int64."""

    @abstractmethod
    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of the new tokens over their whole context (already written).

        query: [num_tokens, num_heads, head_dim]; num_heads is a multiple of num_kv_heads (GQA).
        Returns [num_tokens, num_heads, head_dim] in query's dtype.
        """
