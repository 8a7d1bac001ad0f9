"""Triton GEMM for 4- and 8-bit weights with per-group scales and zero points and 16-bit
activations (W4A16 / W8A16), over the canonical layout of quant/wna16.py, which AWQ and GPTQ
checkpoints are repacked into once at load:

    qweight int32 [K * bits / 32, N]   field j of row r = input r * 32/bits + j
    scales, zeros [G, N]               w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]
    g = k // group_size, or g_idx[k] (int32 [K]) when given

The weights are dequantized in registers, tile by tile, and never written out. Paths:

Which path and launch parameters a shape gets at decode sizes: a table's entry, the start-up
autotuner's pick or the rule (`_config`; quant/kernels/wna16_configs.py, core/kernels/
autotune.py):

- batch 1: the CUDA-core GEMV of wna16_gemv.py, with the fp16x2 fields of wna16_half2.py
  (``half2``: 4 bits, 16-bit activations; ``PAGEBATCH_W4A16_HALF2=0`` turns them off);
- 2-16 rows, 4 bits, 16-bit activations: the tensor-core kernel of w4a16_mma.py (up to 16 rows
  for the price of one: on an H200 the 8B gate/up product at 16 rows takes 45 us there against
  117 us on the split-K GEMM below);
- other decode sizes (M <= 16: g_idx, 8 bits, fp32 activations): split-K — the K tiles are
  spread over ``SPLIT_K`` programs per output tile, each adds its fp32 partial sum with an
  atomic add, so that a GEMV-shaped problem still fills the GPU (the weight read is the whole
  cost);
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

from pagebatch.kernels import autotune, num_sms, precompile

from . import CONFIG_DIR, wna16_configs
from .w4a16_mma import w4a16_mma
from .wna16_configs import DECODE_MAX_M, pick_config, shape_key  # noqa: F401 (re-exported)
from .wna16_gemv import wna16_gemv

DENSE_MIN_M = 1024  # from this many rows on, dequantize + cuBLAS (scripts/bench_quant.py)
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
    cfg = _config(x, qweight, bits, group_size, None, scales=scales, zeros=zeros, gated=True)
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
    cfg = _config(x, qweight, bits, group_size, g_idx, scales=scales, zeros=zeros)
    return run_config(x, qweight, scales, zeros, bits, group_size, g_idx, cfg)


def _config(x: torch.Tensor, qweight: torch.Tensor, bits: int, group_size: int,
            g_idx: torch.Tensor | None, *, scales: torch.Tensor | None = None,
            zeros: torch.Tensor | None = None, gated: bool = False) -> dict:
    """The config of this product's shape and rows, chosen once per shape, rows, device and
    activation dtype: a table's entry, else (CUDA, decode sizes, no g_idx, the weights given)
    the autotuner's pick of the rule's candidates timed on these weights (core/kernels/
    autotune.py; ``gated``: as the gate/up product runs, SiLU-and-mul included), else the rule
    (quant/kernels/wna16_configs.py). The first call of a shape decides for both uses."""
    m, k = x.shape
    n = qweight.shape[1]
    act16 = x.dtype in _ACT16
    key = (m, n, k, group_size, g_idx is not None, x.device, bits, x.dtype)
    cfg = _chosen.get(key)
    if cfg is not None:
        return cfg
    if g_idx is None and m <= DECODE_MAX_M and x.is_cuda and scales is not None:
        cfg = _autotuned(x, qweight, scales, zeros, bits, group_size, act16, gated)
    else:
        cfg = pick_config(m, n, k, group_size, g_idx is not None, x.device, bits, act16=act16)
    if cfg.get("kernel") == "mma" and not act16:  # fp32 activations: no MMA path
        cfg = pick_config(m, n, k, group_size, g_idx is not None, x.device, bits,
                          tuned_table=False)
    if cfg.get("half2") and (not act16 or not half2_allowed()):
        cfg = {**cfg, "half2": 0}  # fp32 activations (or the env) keep fp32 fields
    precompile.remember(_chosen, key, cfg)
    return cfg


def _autotuned(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, bits: int, group_size: int, act16: bool,
               gated: bool) -> dict:
    """`autotune.choose` for a decode-size product without g_idx; ``gated``: each candidate
    timed as the gate/up product runs (its gated epilogue, or the product then the SiLU-and-mul
    kernel), as scripts/bench_quant.py tunes GATED_SHAPES."""
    m, k = x.shape
    n = qweight.shape[1]
    sms = num_sms(x.device)
    allow_h2 = act16 and half2_allowed()

    def candidates(rows: int) -> list[dict]:
        """The rule's candidates for 16-bit or fp32 activations (``act16`` also picks the MMA
        kernel at 2-16 rows); with half2 off (PAGEBATCH_W4A16_HALF2=0) its fp32-field twins."""
        out = []
        for c in wna16_configs.candidates(rows, n, k, group_size, False, sms, bits, act16):
            c = c if allow_h2 or not c.get("half2") else {**c, "half2": 0}
            if c not in out:
                out.append(c)
        return out

    def bench(rows: int):
        from pagebatch.kernels.activation import silu_and_mul

        xb = torch.randn(rows, k, device=x.device, dtype=x.dtype)
        ref = xb @ wna16_dequantize(qweight, scales, zeros, bits, group_size, None, x.dtype)

        def run(cfg: dict) -> torch.Tensor:
            out = run_config(xb, qweight, scales, zeros, bits, group_size, None, cfg,
                             gated=gated)
            if out is None:  # no gated epilogue: the product, then the activation kernel
                out = silu_and_mul(run_config(xb, qweight, scales, zeros, bits, group_size,
                                              None, cfg))
            return out
        return run, silu_and_mul(ref) if gated else ref

    return autotune.choose("wna16", x.device, shape_key(bits, n, k, group_size), m,
                           CONFIG_DIR, candidates, bench)
