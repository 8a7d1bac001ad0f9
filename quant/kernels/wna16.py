"""Triton GEMM for 4- and 8-bit weights with per-group scales and zero points and 16-bit
activations (W4A16 / W8A16), over the canonical layout of quant/wna16.py, which AWQ and GPTQ
checkpoints are repacked into once at load:

    qweight int32 [K * bits / 32, N]   field j of row r = input r * 32/bits + j
    scales, zeros [G, N]               w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]
    g = k // group_size, or g_idx[k] (int32 [K]) when given

The weights are dequantized in registers, tile by tile, and never written out. Paths:

- batch 1 (and the decode sizes a tuned table gives it): the CUDA-core GEMV of wna16_gemv.py,
  with the fp16x2 fields of wna16_half2.py where the table says ``half2`` (16-bit activations;
  ``PAGEBATCH_W4A16_HALF2=0`` turns them off);
- decode sizes where the tuned table says so (4 bits, 16-bit activations): the tensor-core
  kernel of w4a16_mma.py (up to 16 rows for the price of one: on an H200 the 8B gate/up
  product at 16 rows takes 45 us there against 117 us on the split-K GEMM below);
- decode sizes (M <= 16): split-K — the K tiles are spread over ``SPLIT_K`` programs per output
  tile, each adds its fp32 partial sum with an atomic add, so that a GEMV-shaped problem still
  fills the GPU (the weight read is the whole cost);
- prefill sizes: one program per (M, N) tile walks all of K;
- M >= ``DENSE_MIN_M``: dequantize the whole weight once (`wna16_dequantize`) and call cuBLAS,
  as AutoAWQ does for large inputs (the GEMM is then compute-bound and cuBLAS is faster).

Group handling (``GROUP_MODE``): 0 — a K tile lies inside one group (``BLOCK_K`` divides
``group_size``): one row of scales and zeros per tile; 1 — ``k // group_size`` per row; 2 —
``g_idx[k]`` per row. Kernels also run under ``TRITON_INTERPRET=1`` (fp16/fp32) for CI.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagebatch.kernels import num_sms, tuned

from . import CONFIG_DIR
from .w4a16_mma import w4a16_mma
from .wna16_gemv import gemv_supported, wna16_gemv

DENSE_MIN_M = 1024  # from this many rows on, dequantize + cuBLAS (scripts/bench_quant.py)
DECODE_MAX_M = 16
_chosen: dict[tuple, dict] = {}  # pick_config's result per shape, device and activation dtype
_ACT16 = (torch.bfloat16, torch.float16)  # activations the MMA kernel and half2 take
HALF2_ENV = "PAGEBATCH_W4A16_HALF2"


@functools.cache
def half2_allowed() -> bool:
    """Whether tuned configs may take the GEMV's fp16x2 fields (``half2``; 16-bit activations
    only, read as fp16: see quant/kernels/wna16_half2.py for the range and precision);
    ``PAGEBATCH_W4A16_HALF2=0`` keeps the fp32 arithmetic (read once per process)."""
    return os.environ.get(HALF2_ENV, "1") != "0"


@triton.jit(do_not_specialize=["M"])
def _wna16_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, group_size,
                       stride_xm, stride_qk, stride_sg, stride_om,
                       BITS: tl.constexpr, GROUP_MODE: tl.constexpr, SPLIT_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        q = tl.load(q_ptr + (offs_k // PF)[:, None] * stride_qk + offs_n[None, :], mask=w_ok,
                    other=0)
        q = ((q >> ((offs_k % PF) * BITS)[:, None]) & MASK).to(tl.float32)
        if GROUP_MODE == 0:
            g = (kt * BLOCK_K) // group_size
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        else:
            if GROUP_MODE == 1:
                g = offs_k // group_size
            else:
                g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
            sz = g[:, None] * stride_sg + offs_n[None, :]
            s = tl.load(s_ptr + sz, mask=w_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=w_ok, other=0.0).to(tl.float32)
            w = (q - z) * s
        acc += tl.dot(x, w.to(x.dtype))
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_ok)


@triton.jit
def _wna16_dequant_kernel(q_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, group_size,
                          stride_qk, stride_sg, stride_ok,
                          BITS: tl.constexpr, HAS_GIDX: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_k < K
    ok = k_ok[:, None] & (offs_n < N)[None, :]
    q = tl.load(q_ptr + (offs_k // PF)[:, None] * stride_qk + offs_n[None, :], mask=ok, other=0)
    q = ((q >> ((offs_k % PF) * BITS)[:, None]) & MASK).to(tl.float32)
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
    else:
        g = offs_k // group_size
    sz = g[:, None] * stride_sg + offs_n[None, :]
    s = tl.load(s_ptr + sz, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz, mask=ok, other=0.0).to(tl.float32)
    w = (q - z) * s
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :],
             w.to(out_ptr.dtype.element_ty), mask=ok)


def _num_sms(device: torch.device) -> int:
    return num_sms(device) if device.type == "cuda" else 8  # the interpreter: any small number


def shape_key(bits: int, n: int, k: int, group_size: int) -> str:
    """The key of a layer shape in the tuned-config tables (quant/kernels/configs/, read by
    core/kernels/tuned.py)."""
    return f"bits={bits},n={n},k={k},group={group_size}"


def pick_config(m: int, n: int, k: int, group_size: int, has_g_idx: bool,
                device: torch.device, bits: int = 4, tuned_table: bool = True) -> dict:
    """Path and launch parameters for an [m, k] x [k, n] product: ``kernel`` is ``gemv``
    (wna16_gemv.py, CUDA cores), ``mma`` (w4a16_mma.py; only from a tuned table, 16-bit
    activations) or ``gemm`` (this file's tensor-core kernel), with their block sizes, split-K,
    warps and stages. A config measured on this GPU (scripts/bench_quant.py --tune and
    --only tune-mma; quant/kernels/configs/) wins unless ``tuned_table`` is False; otherwise
    heuristics."""
    if tuned_table and not has_g_idx and m <= DECODE_MAX_M:
        cfg = tuned.lookup("wna16", device, shape_key(bits, n, k, group_size), m, CONFIG_DIR)
        if cfg is not None:
            return cfg
    if m == 1 and not has_g_idx:
        for kp in (16, 8, 4):
            if gemv_supported(bits, group_size, kp, False):
                # what the H200 tuning picked for most 8B shapes: 64 columns, 2 warps, enough
                # splits for ~4 programs per SM
                block_n = 64
                tiles = triton.cdiv(n, block_n)
                k_tiles = triton.cdiv(k, kp * (32 // bits))
                split = min(triton.next_power_of_2(max(1, 4 * _num_sms(device) // tiles)),
                            k_tiles, 16)
                return dict(kernel="gemv", block_n=block_n, block_kp=kp, split_k=split,
                            num_warps=2, num_stages=3)
    if m <= DECODE_MAX_M:
        cfg = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = dict(block_m=max(16, triton.next_power_of_2(m)), block_n=128, block_k=64,
                   num_warps=4, num_stages=4)
    else:
        cfg = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if not has_g_idx and group_size % cfg["block_k"] and group_size >= 16 and (
            group_size & (group_size - 1)) == 0:
        cfg["block_k"] = min(cfg["block_k"], group_size)  # keep one group per K tile
    split = 1
    if m <= DECODE_MAX_M:
        tiles = triton.cdiv(n, cfg["block_n"]) * triton.cdiv(m, cfg["block_m"])
        k_tiles = triton.cdiv(k, cfg["block_k"])
        want = max(1, 2 * _num_sms(device) // tiles)
        split = min(triton.next_power_of_2(want), k_tiles, 16)
    cfg["split_k"] = split
    cfg["kernel"] = "gemm"
    return cfg


def run_config(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, bits: int, group_size: int, g_idx: torch.Tensor | None,
               cfg: dict, gated: bool = False) -> torch.Tensor | None:
    """Run the product with a config of `pick_config` (or a sweep's; its other keys are the
    kernel's keywords, e.g. the GEMV's ``half2`` 0/1). ``gated``: SiLU-and-mul of the product
    (W's N columns N/2 gate then N/2 up) through the kernel's gated epilogue, or None where the
    config's kernel (the split-K GEMM) has none."""
    params = {key: v for key, v in cfg.items() if key != "kernel"}
    if cfg.get("kernel") == "gemv":
        return wna16_gemv(x, qweight, scales, zeros, bits, group_size, gated=gated, **params)
    if cfg.get("kernel") == "mma":
        return w4a16_mma(x, qweight, scales, zeros, group_size, gated=gated, **params)
    if gated:
        return None
    return wna16_gemm(x, qweight, scales, zeros, bits, group_size, g_idx, **params)


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, bits: int, group_size: int,
               g_idx: torch.Tensor | None = None, *, block_m: int, block_n: int, block_k: int,
               split_k: int = 1, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """The fused kernel with explicit tile sizes. x: [M, K] fp16/bf16/fp32 (contiguous rows);
    qweight int32 [K*bits/32, N]; scales, zeros [G, N]; g_idx int32 [K] or None.
    Returns [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not match K={k} at {bits} bits")
    if group_size <= 0:
        raise ValueError(f"wna16_gemm: group_size={group_size}; resolve -1 (one group) to K "
                         f"first, as the layers do")
    x = x.contiguous()
    if g_idx is not None:
        mode = 2
    elif group_size % block_k == 0:
        mode = 0
    else:
        mode = 1
    if split_k > 1:
        out = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _wna16_gemm_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
        m, n, k, group_size, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, GROUP_MODE=mode, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out.to(x.dtype) if split_k > 1 else out


def wna16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bits: int, group_size: int, g_idx: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None, block_k: int = 64,
                     block_n: int = 128) -> torch.Tensor:
    """Canonical tensors -> W^T [K, N] in ``dtype`` (default: ``scales``')."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    out = torch.empty(k, n, device=qweight.device, dtype=dtype or scales.dtype)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _wna16_dequant_kernel[grid](
        qweight, scales, zeros, g_idx if g_idx is not None else qweight, out, n, k, group_size,
        qweight.stride(0), scales.stride(0), out.stride(0), BITS=bits,
        HAS_GIDX=g_idx is not None, BLOCK_K=block_k, BLOCK_N=block_n)
    return out


def wna16_matmul_silu_mul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor, bits: int, group_size: int
                          ) -> torch.Tensor | None:
    """SiLU-and-mul of ``x @ W^T`` for W's ``2 * D`` columns (D gate, then D up) as one launch
    of the CUDA-core GEMV or the tensor-core kernel (their gated epilogues): x [M, K] -> [M, D].
    None where the product's config (the same as the plain product's, `pick_config`) is
    neither: the caller then runs the product and the activation."""
    m = x.shape[0]
    if m == 0 or group_size <= 0 or m > DECODE_MAX_M:
        return None
    cfg = _config(x, qweight, bits, group_size, None)
    return run_config(x, qweight, scales, zeros, bits, group_size, None, cfg, gated=True)


def wna16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, bits: int, group_size: int,
                 g_idx: torch.Tensor | None = None, dense_min_m: int = DENSE_MIN_M
                 ) -> torch.Tensor:
    """``x @ W^T`` for x [M, K] (fp16/bf16) -> [M, N] in x's dtype, choosing the path by M."""
    m = x.shape[0]
    if group_size <= 0:
        raise ValueError(f"wna16_matmul: group_size={group_size}; resolve -1 (one group) to K "
                         f"first, as the layers do")
    if m == 0:
        return x.new_empty(0, qweight.shape[1])
    if m >= dense_min_m:
        return x @ wna16_dequantize(qweight, scales, zeros, bits, group_size, g_idx, x.dtype)
    cfg = _config(x, qweight, bits, group_size, g_idx)
    return run_config(x, qweight, scales, zeros, bits, group_size, g_idx, cfg)


def _config(x: torch.Tensor, qweight: torch.Tensor, bits: int, group_size: int,
            g_idx: torch.Tensor | None) -> dict:
    """`pick_config`'s choice for this product's shape and rows, asked once per shape."""
    key = (x.shape[0], qweight.shape[1], x.shape[1], group_size, g_idx is not None, x.device,
           bits, x.dtype)
    cfg = _chosen.get(key)
    if cfg is None:  # first product of this shape: heuristics or the tuned table, once
        cfg = pick_config(*key[:-1])
        if cfg.get("kernel") == "mma" and x.dtype not in _ACT16:
            cfg = pick_config(*key[:-1], tuned_table=False)  # fp32 activations: no MMA path
        if cfg.get("half2") and (x.dtype not in _ACT16 or not half2_allowed()):
            cfg = {**cfg, "half2": 0}  # fp32 activations (or the env) keep fp32 fields
        _chosen[key] = cfg
    return cfg
