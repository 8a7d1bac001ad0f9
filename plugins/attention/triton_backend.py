"""``triton``: paged attention in Triton kernels, the default attention backend on CUDA.

Kernels in triton_kernels.py (imported on first use, so that loading this plugin costs no Triton
import and ``TRITON_INTERPRET`` is read only by whoever runs the kernels). KV layout: the default
``[2, num_blocks, block_size, num_kv_heads, head_dim]``. Any block size, any GQA group, head_dim
up to 256 (tiles are padded to a power of two and masked). The cache is in the query's dtype
(fp16/bf16/fp32) or fp8 e4m3 with per-layer k_scale / v_scale (``kv_cache_dtype: fp8``; e4m3
conversions need sm89+ on CUDA). A sliding window (``sliding_window=W``, transformers' mask:
position i sees keys j with i - W < j <= i) skips the key tiles wholly before a query block's
window, masks the boundary tiles and loads no key below the window (the block manager may have
handed those blocks to another request); split-KV splits only the window.

On CPU the backend runs only under ``TRITON_INTERPRET=1`` (tests on tiny shapes).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pagebatch.attention import (FP8_E4M3_MAX, FP8_KV_DTYPE, AttentionBackend,
                                 AttentionMetadata, BatchPart)
from pagebatch.hookspecs import hookimpl
from pagebatch.kernels import num_sms

from .prefill import PrefillConfig, launch_options as _launch_options, prefill_attention

logger = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256  # context positions a split-KV program reads at least
# the prefill kernel takes a step's prefills when their longest context is at most this many
# times their longest chunk: it reads new keys contiguously (TMA) but a cached prefix through
# the block table, where the paged kernel is faster (H200, session 11: 4096 fresh tokens 479
# vs 358 TFLOP/s; a 512-token chunk after 3584 cached 152.9 vs 120.9 us)
PREFILL_KERNEL_MAX_CONTEXT = 4
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one paged-attention launch. ``block_m`` rows = ``block_m // G`` tokens x G
    query heads; ``tile_n`` keys per inner step; ``num_splits`` > 1 takes the split-KV path."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()




def choose_config(num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int,
                  num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> LaunchConfig:
    """Tiles for a batch: 16-row tiles when every request has few new tokens (decodes), up to
    128 rows for prefill chunks; split-KV when the batch's programs alone cannot fill the GPU
    twice over and contexts are long enough to give each split MIN_TOKENS_PER_SPLIT keys, in a
    power-of-two count (1, 2, 4, ... MAX_SPLITS: few compiled variants, all compiled at
    start-up: core/step_warmup.py)."""
    d_pad = max(_next_pow2(head_dim), 16)
    big = d_pad > 128 or dtype == torch.float32
    block_m = min(max(_next_pow2(max_query_len * group), 16), 64 if big else 128)
    block_m = max(block_m, _next_pow2(group))
    if device.type != "cuda":  # the interpreter: the smallest tiles run fastest; tests force splits
        return LaunchConfig(block_m, 16, 4, 1)
    # measured on an H200 (docs/benchmarks.md, scripts/bench_kernels.py --sweep)
    if block_m <= 16:  # decode-like: memory bound; 64-key tiles, double-buffered
        tile_n, warps, stages = (32 if d_pad > 128 else 64), 4, 2
    elif block_m >= 128 and not big:  # long prefill chunks: 128 x 128 tiles
        tile_n, warps, stages = 128, 8, 3
    else:
        tile_n, warps, stages = (32 if big else 64), (8 if big else 4), (2 if big else 3)
    block_q = max(block_m // group, 1)
    q_blocks = num_seqs if max_query_len <= block_q else num_tokens // block_q + num_seqs
    programs = q_blocks * num_kv_heads
    target = 2 * num_sms(device)
    splits = 1
    if programs < target:
        splits = max(1, min(-(-target // programs), max_seq_len // MIN_TOKENS_PER_SPLIT,
                            MAX_SPLITS))
        # a power of two (still >= one program per SM): NUM_SPLITS is a compile-time constant,
        # and any count would compile a kernel variant per new batch shape while serving
        splits = 1 << (splits.bit_length() - 1)
    return LaunchConfig(block_m, tile_n, warps, stages, splits)


_warned: list[bool] = []  # the capture warning, once per process


def _counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's split-K counters (core/kernels/splitk.py) for a fused split-KV reduction
    of ``needed`` (query block, kv head) pairs, or None (the separate reduction kernel then
    runs): more pairs than counters, or the counters not allocated before a CUDA graph is
    captured. Every eager launch allocates them (also without splits), so the engine's eager
    warm-up has done it before capture."""
    from pagebatch.kernels import splitk

    if (not splitk.counters_ready(device) and device.type == "cuda"
            and torch.cuda.is_current_stream_capturing()):
        if not _warned:
            _warned.append(True)
            logger.warning("split-KV counters not allocated before CUDA-graph capture: the "
                           "graphs merge splits in a second kernel")
        return None
    buf = splitk.counter_buffer(device)
    return buf if needed <= splitk.MAX_COUNTERS else None


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None,
             store_rotated: bool = False) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64 (negative: skip the token). An
    fp8 cache stores ``x / scale`` clamped to +-448 (scales ignored for other caches).
    ``rope``: (positions [num_tokens] int64, cos_sin [max_position, head_dim] fp32): key is
    rotated (RoPE, rotate-half) before it is stored; with ``store_rotated`` the rotated key is
    also written back into ``key`` (in place; skipped tokens stay as they were), so that the
    prefill path can read this step's keys from it."""
    from . import triton_kernels as tk

    t, hkv, d = key.shape
    if t == 0:
        return
    given = key
    if key.stride(2) != 1 or key.stride(1) != d:
        key = key.contiguous()
    if value.stride(2) != 1 or value.stride(1) != d:
        value = value.contiguous()
    row = hkv * d
    store = store_rotated and rope is not None
    block = _next_pow2(row) if store else min(_next_pow2(row), 2048)  # store: one program a row
    fp8 = kv_cache.dtype == FP8_KV_DTYPE
    pos, cos_sin = rope if rope is not None else (slot_mapping, key)
    tk.write_kv_kernel[(t, -(-row // block))](
        key, value, kv_cache[0], kv_cache[1], slot_mapping, pos, cos_sin, key.stride(0),
        value.stride(0), float(k_scale) if fp8 else 1.0, float(v_scale) if fp8 else 1.0,
        ROW=row, BLOCK=block, FP8=fp8, FP8_MAX=FP8_E4M3_MAX, ROPE=rope is not None,
        HEAD_DIM=d, STORE_ROTATED=store, num_warps=4, **_launch_options(key.device))
    if store and key is not given:
        given.copy_(key)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, config: LaunchConfig | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    prefill_config: PrefillConfig | None = None,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of the new tokens over their paged context.

    query: [num_tokens, num_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim] in query's dtype, or fp8 e4m3 read as ``float(entry) * k_scale`` (``v_scale``;
    scales ignored for other caches). Returns [num_tokens, num_heads, head_dim] in query's dtype.
    ``rope``: (positions, cos_sin) as for `write_kv`: the query is rotated as it is loaded.
    ``new_kv``: this step's (key, value) [num_tokens, num_kv_heads, head_dim] as the cache holds
    them (rotated, with ``rope``: `write_kv` with ``store_rotated``): prefill requests then take
    the prefill kernel (prefill.py), reading their own new keys from it, unless their longest
    context passes PREFILL_KERNEL_MAX_CONTEXT times their longest chunk (or a
    ``prefill_config`` is given: always); ignored for fp8 caches.

    A step's decodes (one new token) and prefills launch apart, each with its own tiles (from
    one metadata: `AttentionMetadata.parts`, worked out on the host). ``config`` overrides the
    tiles and runs every request in one launch of the paged kernel (benchmarks, tests);
    ``prefill_config`` the prefill kernel's. ``sliding_window``: tokens each query attends
    over (None: the whole causal context). Raises ValueError for head_dim above 256.
    """
    t, hq, d = query.shape
    _, _, block_size, hkv, d_cache = kv_cache.shape
    if d > MAX_HEAD_DIM or d != d_cache:
        raise ValueError(f"head_dim={d} (cache {d_cache}): the triton backend supports "
                         f"head_dim up to {MAX_HEAD_DIM}, equal in query and cache")
    out = torch.empty((t, hq, d), dtype=query.dtype, device=query.device)
    if t == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if kv_cache.dtype != FP8_KV_DTYPE:
        k_scale = v_scale = 1.0
    elif new_kv is not None:
        new_kv = None  # the reference reads the rounded cache entries
    if config is not None:
        whole = BatchPart(0, metadata.num_seqs, 0, t, metadata.max_query_len,
                          metadata.max_seq_len, True)
        _paged(out, query, kv_cache, metadata, whole, scale, config, 0, k_scale, v_scale, rope,
               sliding_window)
        return out
    decodes, prefills = metadata.parts
    if decodes is not None:
        _paged(out, query, kv_cache, metadata, decodes, scale, None,
               0 if decodes.pure else 1, k_scale, v_scale, rope, sliding_window)
    if prefills is not None:
        if new_kv is not None and (prefill_config is not None or prefills.max_seq_len
                                   <= PREFILL_KERNEL_MAX_CONTEXT * prefills.max_query_len):
            prefill_attention(out, query, new_kv, kv_cache, metadata, prefills, scale,
                              prefill_config, rope, sliding_window)
        else:
            _paged(out, query, kv_cache, metadata, prefills, scale, None,
                   0 if prefills.pure else 2, k_scale, v_scale, rope, sliding_window)
    return out


def _paged(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
           metadata: AttentionMetadata, part: BatchPart, scale: float,
           config: LaunchConfig | None, kind: int, k_scale: float, v_scale: float,
           rope: tuple[torch.Tensor, torch.Tensor] | None,
           sliding_window: int | None = None) -> None:
    """One launch of the paged kernel over ``part``'s requests (``kind``: the kernel's KIND),
    writing their rows of ``out``. With a window, the tiles and splits are chosen for the keys
    a query block reads (at most window + max_query_len), not the whole context."""
    from . import triton_kernels as tk

    t, hq, d = query.shape
    _, _, block_size, hkv, _ = kv_cache.shape
    group = hq // hkv
    a, b = part.seq_begin, part.seq_end
    n = part.tok_end - part.tok_begin
    keys = part.max_seq_len
    if sliding_window is not None:
        keys = min(keys, sliding_window + part.max_query_len)
    cfg = config or choose_config(n, b - a, part.max_query_len, keys, hkv, group, d,
                                  query.dtype, query.device)
    block_q = max(cfg.block_m // group, 1)
    num_q_blocks = n // block_q + (b - a)
    d_pad = max(_next_pow2(d), 16)
    splits = cfg.num_splits
    if splits > 1:
        part_acc = torch.empty((n, hq, splits, d_pad), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((n, hq, splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    cnt = _counters(query.device, num_q_blocks * hkv)
    if splits == 1:
        cnt = None
    tables = metadata.block_tables[a:b]
    tk.paged_attention_kernel[(num_q_blocks, hkv, splits)](
        out, query, kv_cache[0], kv_cache[1], tables, metadata.seq_lens[a:b],
        metadata.query_start_loc[a:b + 1], part_acc, part_ml, out if cnt is None else cnt,
        *(rope if rope is not None else (metadata.seq_lens, query)),
        b - a, num_q_blocks, part.tok_begin, scale, float(k_scale), float(v_scale),
        sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        NUM_KV_HEADS=hkv, G=group, HEAD_DIM=d, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n, NUM_SPLITS=splits,
        DOT_PRECISION=precision, FUSED_REDUCE=cnt is not None, ROPE=rope is not None, KIND=kind,
        SLIDING=sliding_window is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_launch_options(query.device))
    if splits > 1 and cnt is None:
        rows = out[part.tok_begin:part.tok_end]
        tk.reduce_splits_kernel[(n, hq)](
            rows, part_acc, part_ml, hq, out.stride(0), out.stride(1),
            HEAD_DIM=d, HEAD_DIM_PAD=d_pad, NUM_SPLITS=splits, SPLITS_PAD=_next_pow2(splits),
            num_warps=4, **_launch_options(query.device))


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_fp8_kv_cache = True
    supports_fused_rope = True
    accepts_new_kv = True
    supports_sliding_window = True

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return (f"it runs Triton kernels, which need a CUDA device (device is "
                    f"{device.type!r}; TRITON_INTERPRET=1 runs them on the CPU, for tests)")
        if dtype not in _DTYPES:
            return f"dtype {dtype} is not supported; supported: float16, bfloat16, float32"
        return None

    def supports_kv_cache_dtype(self, device, dtype, kv_dtype):
        if (kv_dtype == FP8_KV_DTYPE and device.type == "cuda"
                and torch.cuda.get_device_capability(device) < (8, 9)):
            return ("Triton converts fp8 e4m3 only on compute capability 8.9+ (Ada, Hopper); "
                    f"this GPU is {torch.cuda.get_device_capability(device)}")
        return super().supports_kv_cache_dtype(device, dtype, kv_dtype)

    def write_kv(self, key, value, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0, rope=None):
        # with rope, key is rotated in place too: `forward`'s new_kv then holds the cache's keys
        write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale, rope, store_rotated=True)

    def forward(self, query, kv_cache, metadata: AttentionMetadata, scale, k_scale=1.0,
                v_scale=1.0, rope=None, new_kv=None, sliding_window=None):
        return paged_attention(query, kv_cache, metadata, scale, None, k_scale, v_scale, rope,
                               new_kv, sliding_window=sliding_window)


@hookimpl
def register_attention_backends(register):
    register("triton", TritonBackend)

