"""Piecewise CUDA graphs: a step with prefill tokens replays everything but attention.

A decode-only step replays one CUDA graph of the whole forward (core/cuda_graphs.py). A step
that carries prefill chunks could not: its attention launch depends on the query lengths. Run
eagerly, the Llama-3.1-8B shape spent ~21 ms per such step on the host (launches of ~32 x 15
kernels from Python) against 7.4 ms of GPU work for 32 decodes + a 64-token chunk, and 14 ms
for a 512-token chunk (scripts/mixed_step.py, H100, session 37): in a served run at a request
rate nearly every step is of that kind. Here the forward is cut at each attention call, as
vLLM's piecewise CUDA graphs cut it (there through torch.compile's graph splitting; here by a
hook in `pagebatch.layers.attention.Attention`): for each bucketed token count T
(``sizes``: 8, 16, 24, ... ``max_tokens``) one graph per piece between two attention calls
(num_layers + 1 pieces: embedding .. layer 0's q/k/v, layer i's o_proj .. layer i+1's
q/k/v, the last o_proj .. the final norm), all sharing one memory pool. A step of
t <= max_tokens tokens copies its ids and positions into the static inputs, replays piece 0,
runs layer 0's attention eagerly on the first t rows of the static q/k/v (with the step's real
metadata: any backend, any query lengths), copies its output into the static buffer piece 1
reads, replays piece 1, and so on.

Every operation inside a piece acts on each token's row alone (GEMMs, norms, activations,
embedding), so the padding rows t..T carry stale but finite values that reach no real row; the
caller reads the first t rows of the output. One process, no tensor or pipeline parallelism
(their collectives are not captured here). ``num_replays`` counts steps run.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .attention import AttentionMetadata
from .layers import attention as attention_layer

logger = logging.getLogger(__name__)

MIN_SIZE = 8


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Token counts captured, ascending: 8, 16, 24, 32, then steps of a quarter of the power
    of two below (40, 48, 56, 64, 80, ..., 128, 160, ..., 256, 320, ...), and ``max_tokens``
    itself, the largest (a step pays at most 25 % padding, 8 tokens below 32). [] for 0."""
    if max_tokens <= 0:
        return []
    sizes, s = [], MIN_SIZE
    while s < max_tokens:
        sizes.append(s)
        s += max(MIN_SIZE, (1 << (s.bit_length() - 1)) // 4)
    return sizes + [max_tokens]


@dataclass
class _Call:
    """One attention call between two pieces: the layer, its cache, its rotary (or None),
    and the static (q, k, v, out) buffers it reads and writes."""
    layer: Any
    kv_cache: torch.Tensor
    rotary: Any
    bufs: tuple


@dataclass
class _Bucket:
    graphs: list = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    output: torch.Tensor | None = None


class PiecewiseGraphs:
    """``forward(ids [T] int32, positions [T] int32, meta) -> hidden [T, H]`` is the model's
    call; ``max_tokens`` the largest step captured; ``dummy_meta(T)`` a metadata of one
    T-token request that writes no KV (its slot mapping all padding), for the uncaptured run
    each size gets before its capture (it compiles and settles the allocator)."""

    def __init__(self, forward: Callable[..., torch.Tensor], max_tokens: int,
                 device: torch.device, dummy_meta: Callable[[int], AttentionMetadata],
                 index_dtype: torch.dtype = torch.int32):
        self.sizes = piecewise_sizes(max_tokens)
        self._forward = forward
        self._dummy_meta = dummy_meta
        n = self.sizes[-1] if self.sizes else 0
        self.ids = torch.zeros(n, dtype=index_dtype, device=device)
        self.positions = torch.zeros(n, dtype=index_dtype, device=device)
        self._static: dict[tuple, tuple[torch.Tensor, ...]] = {}  # (shapes, dtype) -> q, k, v, out
        self.buckets: dict[int, _Bucket] = {}
        self.num_replays = 0
        self._device = device

    def bucket(self, num_tokens: int) -> int | None:
        """The captured size for a step of ``num_tokens`` tokens, or None (run it eagerly)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        if i == len(self.sizes):
            return None
        return self.sizes[i] if self.sizes[i] in self.buckets else None

    def _buffers(self, q: torch.Tensor, k: torch.Tensor, out_width: int):
        key = (tuple(q.shape[1:]), tuple(k.shape[1:]), out_width, q.dtype)
        bufs = self._static.get(key)
        if bufs is None:
            n, dev = self.sizes[-1], self._device
            bufs = (torch.zeros(n, *q.shape[1:], dtype=q.dtype, device=dev),
                    torch.zeros(n, *k.shape[1:], dtype=k.dtype, device=dev),
                    torch.zeros(n, *k.shape[1:], dtype=k.dtype, device=dev),
                    torch.zeros(n, out_width, dtype=q.dtype, device=dev))
            self._static[key] = bufs
        return bufs

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (one pool), after one uncaptured run each."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self._device)
        for size in reversed(self.sizes):
            ids, pos = self.ids[:size], self.positions[:size]
            meta = self._dummy_meta(size)

            def probe(layer, q, k, v, kv_cache, rope):  # the static buffers, made uncaptured
                self._buffers(q, k, layer.num_heads * layer.head_dim)
                return layer.attend(q, k, v, kv_cache, meta, rope)

            attention_layer.set_split(probe)
            try:
                self._forward(ids, pos, meta)
            finally:
                attention_layer.set_split(None)
            torch.cuda.synchronize(self._device)
            self.buckets[size] = self._capture_one(size, ids, pos, pool, stream)
        torch.cuda.synchronize(self._device)
        logger.info("captured piecewise CUDA graphs for %d token counts (%d..%d), %d pieces "
                    "each, in %.1f s", len(self.sizes), self.sizes[0], self.sizes[-1],
                    len(self.buckets[self.sizes[0]].graphs) if self.sizes else 0,
                    time.perf_counter() - start)

    def _capture_one(self, size: int, ids: torch.Tensor, pos: torch.Tensor, pool: Any,
                     stream: torch.cuda.Stream) -> _Bucket:
        b = _Bucket()
        meta = self._dummy_meta(size)  # read by nothing inside the pieces

        def begin() -> None:
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=pool)
            b.graphs.append(g)

        def split(layer, q, k, v, kv_cache, rope):
            # the piece so far ends with q, k, v copied into the static buffers
            sq, sk, sv, out = self._buffers(q, k, layer.num_heads * layer.head_dim)
            sq[:size].copy_(q)
            sk[:size].copy_(k)
            sv[:size].copy_(v)
            b.graphs[-1].capture_end()
            b.calls.append(_Call(layer, kv_cache, None if rope is None else rope[1],
                                 (sq, sk, sv, out)))
            begin()
            return out[:size]

        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            attention_layer.set_split(split)
            try:
                begin()
                try:
                    b.output = self._forward(ids, pos, meta)
                finally:
                    b.graphs[-1].capture_end()
            finally:
                attention_layer.set_split(None)
        torch.cuda.current_stream(self._device).wait_stream(stream)
        return b

    def run(self, ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The forward of a step of t = len(ids) tokens (a captured size must hold it:
        `bucket`): hidden states [t, H], a view of the size's static output (valid until the
        next replay)."""
        t = ids.shape[0]
        b = self.buckets[self.bucket(t)]
        self.ids[:t].copy_(ids)
        self.positions[:t].copy_(positions)
        pos = self.positions[:t]
        calls = b.calls
        for i, g in enumerate(b.graphs):
            g.replay()
            if i < len(calls):
                c = calls[i]
                sq, sk, sv, out = c.bufs
                o = c.layer.attend(sq[:t], sk[:t], sv[:t], c.kv_cache, meta,
                                   rope=None if c.rotary is None else (pos, c.rotary))
                out[:t].copy_(o)
        self.num_replays += 1
        return b.output[:t]
