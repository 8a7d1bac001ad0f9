"""Host side of the ``triton`` backend's prefill path (kernel in prefill_kernel.py): its tiles
(`PrefillConfig`, `choose_prefill_config`), whether TMA descriptors can be used, and the launch.

The path is taken for the prefill requests of a step (more than one new token) when the
backend's ``forward`` gets the step's new K/V (``new_kv``, core/attention.py) and the cache is
not fp8 (an fp8 cache holds rounded keys; the reference reads those). Tiles are a rule, not a
table: 128-row x 128-key tiles with 8 warps where head_dim <= 128 in 16-bit dtypes (the
FlashAttention-3 / Triton-tutorial shape for wgmma), 64 x 64 (fp32: 64 x 32) with 4 warps
above; as many pipeline stages (at most 3) as the GPU's shared memory holds next to the Q tile;
TMA descriptors on compute capability 9.0+ where the K/V rows allow them (16-byte aligned, a
power-of-two head_dim). Should a compiler need more shared memory than the rule reckons, the
default launch retries with one stage fewer (once per shape: compiles are cached).
``scripts/bench_kernels.py --only prefill --sweep`` times alternatives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagebatch.attention import AttentionMetadata, BatchPart

TMA_OFF, TMA_HOST, TMA_DEVICE = 0, 1, 2
_fitting_stages: dict = {}  # (default config, device) -> stages that fit, where fewer did


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles of one prefill launch: ``block_m`` rows (``block_m // G`` tokens x G query heads),
    ``tile_n`` keys per step; ``tma``: TMA_OFF (pointer loads), TMA_HOST (descriptors built on
    the host, passed by value) or TMA_DEVICE (built in the kernel, workspace from
    ``triton.set_allocator``); ``warp_specialize``: Triton's warp-specialized loop (sm90+)."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    tma: int = TMA_OFF
    warp_specialize: bool = False


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _hopper(idx: int) -> bool:
    return torch.cuda.get_device_capability(idx)[0] >= 9


@functools.cache
def _smem_bytes(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).shared_memory_per_block_optin


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def choose_prefill_config(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device) -> PrefillConfig:
    """Tiles for a step's prefill requests (the rule in the module docstring)."""
    d_pad = max(_next_pow2(head_dim), 16)
    big = d_pad > 128 or dtype == torch.float32
    block_m = min(max(_next_pow2(max_query_len * group), 16), 64 if big else 128)
    block_m = max(block_m, _next_pow2(group))
    if device.type != "cuda":  # the interpreter: the smallest tiles run fastest
        return PrefillConfig(block_m, 16, 4, 1)
    tile_n = 128 if not big else (32 if dtype == torch.float32 else 64)
    warps = 8 if block_m >= 128 else 4
    el = dtype.itemsize
    stage = 2 * tile_n * d_pad * el  # one K and one V tile
    spare = _smem_bytes(_index(device)) - block_m * d_pad * el - 2048  # Q; barriers
    stages = max(1, min(3, spare // stage))
    tma = TMA_HOST if _hopper(_index(device)) and d_pad == head_dim and not big else TMA_OFF
    return PrefillConfig(block_m, tile_n, warps, stages, tma)


def _tma_ok(x: torch.Tensor) -> bool:
    """Whether a [num_tokens, num_kv_heads, head_dim] tensor can back a TMA descriptor of its
    [num_tokens, num_kv_heads * head_dim] rows: 16-byte aligned base and row stride."""
    el = x.element_size()
    return x.data_ptr() % 16 == 0 and (x.stride(0) * el) % 16 == 0


@functools.cache
def _set_allocator() -> None:
    """Device-side descriptors take a small global workspace per program from Triton's
    allocator (process-wide; set once, torch's caching allocator behind it)."""
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(
        size, dtype=torch.int8, device="cuda"))


def prefill_attention(out: torch.Tensor, query: torch.Tensor,
                      new_kv: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                      metadata: AttentionMetadata, part: BatchPart, scale: float,
                      config: PrefillConfig | None = None,
                      rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                      sliding_window: int | None = None) -> None:
    """Writes rows ``part.tok_begin:part.tok_end`` of ``out`` [num_tokens, num_heads, head_dim]
    (query's dtype): causal attention of ``part``'s prefill requests over their cached prefix
    (``kv_cache`` [2, num_blocks, block_size, num_kv_heads, head_dim], same dtype) and their
    new keys ``new_kv`` = (key, value) [num_tokens, num_kv_heads, head_dim] (every row of the
    step; as stored in the cache: rotated when ``rope`` is given, which rotates only q).
    Requests of the range with one new token are skipped unless ``part.pure``.
    ``sliding_window``: tokens each query attends over (transformers' mask), None: all."""
    from triton.runtime.errors import OutOfResources
    from triton.tools.tensor_descriptor import TensorDescriptor

    from . import prefill_kernel as pk

    key, value = new_kv
    t, hq, d = query.shape
    _, _, block_size, hkv, _ = kv_cache.shape
    group = hq // hkv
    cfg = config or choose_prefill_config(part.max_query_len, group, d, query.dtype,
                                          query.device)
    stages = _fitting_stages.get((cfg, query.device), cfg.num_stages)
    if key.stride(2) != 1 or key.stride(1) != d:
        key = key.contiguous()
    if value.stride(2) != 1 or value.stride(1) != d:
        value = value.contiguous()
    k2, v2 = key.flatten(1), value.flatten(1)  # [num_tokens, num_kv_heads * head_dim] views
    d_pad = max(_next_pow2(d), 16)
    tma = cfg.tma
    if tma and (d != d_pad or not (_tma_ok(key) and _tma_ok(value))):
        tma = TMA_OFF
    if tma == TMA_HOST:
        k_src = TensorDescriptor(k2, list(k2.shape), [k2.stride(0), 1], [cfg.tile_n, d])
        v_src = TensorDescriptor(v2, list(v2.shape), [v2.stride(0), 1], [cfg.tile_n, d])
    else:
        k_src, v_src = k2, v2
        if tma == TMA_DEVICE and query.device.type == "cuda":
            _set_allocator()
    ws = cfg.warp_specialize and query.device.type == "cuda" and _hopper(_index(query.device))
    block_q = max(cfg.block_m // group, 1)
    a, b = part.seq_begin, part.seq_end
    num_q_blocks = (part.tok_end - part.tok_begin) // block_q + (b - a)
    tables = metadata.block_tables[a:b]
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    args = (
        out, query, k_src, v_src, kv_cache[0], kv_cache[1], tables, metadata.seq_lens[a:b],
        metadata.query_start_loc[a:b + 1],
        *(rope if rope is not None else (metadata.seq_lens, query)),
        b - a, num_q_blocks, part.tok_begin, t, scale, sliding_window or 0,
        query.stride(0), query.stride(1), k2.stride(0), v2.stride(0), out.stride(0),
        out.stride(1), tables.stride(0))
    consts = dict(
        NUM_KV_HEADS=hkv, G=group, HEAD_DIM=d, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n, TMA=tma,
        WARP_SPECIALIZE=ws, DOT_PRECISION=precision, SKIP_DECODES=not part.pure,
        ROPE=rope is not None, SLIDING=sliding_window is not None, num_warps=cfg.num_warps,
        **launch_options(query.device))
    while True:
        try:
            pk.prefill_attention_kernel[(num_q_blocks * hkv,)](*args, **consts,
                                                               num_stages=stages)
            return
        except OutOfResources:
            if config is not None or stages == 1:
                raise
            stages -= 1
            _fitting_stages[(cfg, query.device)] = stages


def launch_options(device: torch.device) -> dict:
    """core/kernels/pdl.py's launch options, imported at launch: that module imports Triton,
    which a CPU set-up that only loads the triton plugin (every start does) need not have."""
    from pagebatch.kernels import pdl

    return pdl.launch_options(device)
