"""The attention backend interface and the metadata that describes one step's batch.

A step's batch is flattened: the new tokens of every scheduled request, request after request,
``num_tokens`` in all. Request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]`` and,
after this step, ``seq_lens[i]`` tokens of context in the paged KV cache, read through row ``i``
of ``block_tables``. Prefill chunks and decodes (one row) mix freely.

KV cache dtype (config ``kv_cache_dtype``): the model dtype, or fp8 e4m3 (``torch.float8_e4m3fn``)
as vLLM's ``--kv-cache-dtype fp8`` stores it: each layer has scalar ``k_scale`` / ``v_scale``
(1.0: checkpoint scales are not read yet), a cache entry is ``clamp(x / scale, -448, 448)``
rounded to e4m3 (nearest even) and reads back as ``float(entry) * scale``.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from .errors import ConfigError

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # the largest finite e4m3fn value: stored values are clamped to it
KV_CACHE_DTYPES = {"fp8": FP8_KV_DTYPE, "fp8_e4m3": FP8_KV_DTYPE}


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The cache dtype for config ``kv_cache_dtype``: ``auto`` -> the model's ``dtype``;
    ``fp8`` / ``fp8_e4m3`` -> torch.float8_e4m3fn. Raises ConfigError for another name."""
    if name == "auto":
        return dtype
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={name!r}: allowed: ['auto', "
                          f"{', '.join(map(repr, KV_CACHE_DTYPES))}]")
    return KV_CACHE_DTYPES[name]


@dataclass
class AttentionMetadata:
    """One step's batch layout. Tensors live on the model's device.

    slot_mapping:    [num_tokens] int32 (int64 accepted), cache slot (block_id * block_size +
                     offset) per new token; negative: a padding token, not written
    query_start_loc: [num_seqs + 1] int32, prefix sums of new tokens per request
    seq_lens:        [num_seqs] int32, context length of each request after this step
    block_tables:    [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len, max_seq_len: Python ints (kernel launch sizes)
    query_start_loc_cpu, seq_lens_cpu: the same as lists, for backends that loop on the host
    backend_cache:   a backend's values derived from this step's layout (e.g. torch_ref's
                     flat slot indices of a decode step), worked out in the first layer and
                     reused by the others; keys are the backend's own (prefix them with its
                     name). Empty when the metadata is built
    kv_groups:       a hybrid model's metadata per KV cache group (core/kv_hybrid.py; entry
                     0 is this object; the others differ in slot_mapping and block_tables),
                     or None: every layer reads this one (one group, or a synthetic batch
                     that writes nothing and reads block 0)
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    backend_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    kv_groups: "list[AttentionMetadata] | None" = field(default=None, repr=False,
                                                          compare=False)

    def with_groups(self, groups: list[tuple[torch.Tensor, torch.Tensor]]) -> AttentionMetadata:
        """Set ``kv_groups`` from each group's (slot mapping, block tables), the first being
        this object's own; one group leaves it None. Returns self."""
        if len(groups) > 1:
            self.kv_groups = [self] + [dataclasses.replace(self, slot_mapping=s, block_tables=t)
                                       for s, t in groups[1:]]
        return self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @functools.cached_property
    def parts(self) -> tuple[BatchPart | None, BatchPart | None]:
        """(decodes, prefills): the requests with one new token and those with more, each as
        the smallest `BatchPart` holding them (None: no such request), worked out on the host
        from ``query_start_loc_cpu`` once per step (the metadata is built once per step) so
        that a backend can launch the two kinds with their own tiles. Requests with no new
        token belong to neither."""
        qsl, lens = self.query_start_loc_cpu, self.seq_lens_cpu
        n = len(lens)
        if self.max_query_len <= 1:  # decode-only (CUDA graphs): no per-request loop
            return BatchPart(0, n, 0, qsl[n], 1, self.max_seq_len, True), None
        kinds = [min(qsl[i + 1] - qsl[i], 2) for i in range(n)]  # 0 none, 1 decode, 2 prefill
        return BatchPart.of(kinds, 1, qsl, lens), BatchPart.of(kinds, 2, qsl, lens)


@dataclass(frozen=True)
class BatchPart:
    """Requests ``seq_begin:seq_end`` of a step's batch, whose new tokens are rows
    ``tok_begin:tok_end``; ``pure``: every request in the range is of the part's kind (else a
    launch over the range skips the others); max_query_len / max_seq_len: over the part's
    requests."""

    seq_begin: int
    seq_end: int
    tok_begin: int
    tok_end: int
    max_query_len: int
    max_seq_len: int
    pure: bool

    @classmethod
    def of(cls, kinds: list[int], kind: int, qsl: list[int],
           lens: list[int]) -> BatchPart | None:
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if not idx:
            return None
        a, b = idx[0], idx[-1] + 1
        return cls(a, b, qsl[a], qsl[b], max(qsl[i + 1] - qsl[i] for i in idx),
                   max(lens[i] for i in idx), len(idx) == b - a)


class AttentionBackend(ABC):
    """Reads and writes the paged KV cache. Plugins implement this.

    Layout: ``kv_cache_shape`` gives the shape of one layer's cache tensor; the default is
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V). The cache is allocated
    uninitialized: slots past a request's ``seq_len`` (and padding entries of block tables) may
    hold anything, NaN included, and must never reach the output.
    """

    name: str = "?"
    # True when `forward` and `write_kv` launch work whose shape depends only on the tensors'
    # shapes and metadata.max_query_len / max_seq_len / num_seqs (no host reads of tensor
    # values), so that a decode step can be captured in a CUDA graph (core/cuda_graphs.py)
    supports_cuda_graphs: bool = False
    # True when `write_kv` and `forward` take an fp8 (float8_e4m3fn) cache and the keyword
    # arguments k_scale / v_scale (see the module docstring); they are passed for fp8 caches only
    supports_fp8_kv_cache: bool = False
    # True when `write_kv` and `forward` take ``rope=(positions, cos_sin)`` and apply RoPE
    # (rotate-half, core/layers/rotary.py) to key and query themselves, rounding the rotated
    # values to the model's dtype as the rotary layer does (positions [num_tokens] int64,
    # cos_sin [max_position, head_dim] fp32: cos then sin halves). The attention layer then
    # skips its own rotary launch; without it the layer rotates q and k first
    supports_fused_rope: bool = False
    # True when `forward` takes ``new_kv=(key, value)``: the tensors [num_tokens, num_kv_heads,
    # head_dim] that the layer has just passed to `write_kv` (as that call left them), so that a
    # prefill's keys of this same step can be read contiguously instead of through the block
    # tables. Passed only to backends that set it
    accepts_new_kv: bool = False
    # True when `forward` takes ``sliding_window=W`` (an int, tokens; passed only to layers that
    # have one): the token at position i then attends to the keys j with i - W < j <= i
    # (transformers' ``sliding_window_overlay`` and the causal mask), and must read no block of
    # the block table wholly below the first query's window: the block manager may have handed
    # those blocks to another request (their entries may be the null block, or stale ids)
    supports_sliding_window: bool = False

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when usable on this device and dtype, else a reason."""
        return None

    def supports_kv_cache_dtype(self, device: torch.device, dtype: torch.dtype,
                                kv_dtype: torch.dtype) -> str | None:
        """None when this backend keeps a ``kv_dtype`` cache for a model of ``dtype`` on
        ``device``, else a reason (start then fails with a ConfigError that quotes it)."""
        if kv_dtype == dtype or (kv_dtype == FP8_KV_DTYPE and self.supports_fp8_kv_cache):
            return None
        return (f"the {self.name!r} attention backend has no {kv_dtype} KV cache for a "
                f"{dtype} model")

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store new K/V. key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping:
        [num_tokens] int64. An fp8 cache also gets ``k_scale=``, ``v_scale=`` (floats): store
        ``x / scale`` clamped to +-448."""

    @abstractmethod
    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of the new tokens over their whole context (already written).

        query: [num_tokens, num_heads, head_dim]; num_heads is a multiple of num_kv_heads (GQA).
        Returns [num_tokens, num_heads, head_dim] in query's dtype. An fp8 cache also gets
        ``k_scale=``, ``v_scale=`` (floats): K and V read as ``float(entry) * scale``.
        """
