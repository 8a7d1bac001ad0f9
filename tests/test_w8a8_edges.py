"""Edge cases of the W8A8 pieces: per-token quantization (quant/kernels/per_token_quant.py; NaN
and inf rows, subnormals, extremes) and the int8 GEMM (quant/kernels/int8_gemm.py). The kernel
tests run under ``TRITON_INTERPRET=1`` in a child process on the CPU (tests/interpreted.py). The
interpreter lowers ``tl.maximum`` /
``tl.minimum`` without NaN propagation (np.fmax / np.fmin), as the GPU does (max.f32 / min.f32),
so the NaN behaviour seen here is the GPU's.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import (DEVICE, IN_PROCESS, ON_GPU, kernels_run_here,  # noqa: F401
                         run_under_interpreter)

NAN, INF = float("nan"), float("inf")


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=300)


def _cpu(fn, x):
    q, s = fn(x.cpu())
    return q.to(x.device), s.to(x.device)


def _fp8_reference(x):
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


# ---- what holds ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_zero_rows_tiny_rows_and_empty_shapes(kind):
    from pagebatch.quant.int8 import quantize_per_token
    from pagebatch.quant.kernels.per_token_quant import per_token_quant

    out_dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    ref_fn = quantize_per_token if kind == "int8" else _fp8_reference
    x = torch.tensor([[0.0, -0.0, 0.0, 0.0, 0.0],
                      [1e-40, -2e-40, 0.0, 1e-45, 0.0],        # fp32 subnormals, below eps
                      [3e38, -3e38, 1.0, 0.0, -1.0]], device=DEVICE)  # near fp32 max
    q, s = per_token_quant(x, out_dtype, block=16)
    rq, rs = _cpu(ref_fn, x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.isfinite(s).all()
    q, s = per_token_quant(torch.empty(0, 8, device=DEVICE), out_dtype)
    assert q.shape == (0, 8) and s.shape == (0, 1)
    q, s = per_token_quant(torch.ones(3, 0, device=DEVICE), out_dtype)
    assert q.shape == (3, 0) and s.shape == (3, 1) and torch.isfinite(s).all()


def test_row_stride_zero_and_noncontiguous():
    from pagebatch.quant.int8 import quantize_per_token
    from pagebatch.quant.kernels.per_token_quant import per_token_quant

    row = torch.randn(1, 37, device=DEVICE)
    x = row.expand(4, 37)  # row stride 0
    q, s = per_token_quant(x, torch.int8, block=16)
    rq, rs = _cpu(quantize_per_token, x.contiguous())
    assert torch.equal(q, rq) and torch.equal(s, rs)
    with pytest.raises(ValueError, match="stride"):
        per_token_quant(torch.randn(37, 4, device=DEVICE).t(), torch.int8)


def test_inf_rows_give_nonfinite_outputs():
    """An inf in a row makes the row's scale inf and the W8A8 output row non-finite (the torch
    path gives NaN): the overflow stays visible."""
    from pagebatch.quant.kernels.int8_gemm import int8_scaled_mm
    from pagebatch.quant.kernels.per_token_quant import per_token_quant

    x = torch.tensor([[1.0, INF, -2.0, 0.5], [1.0, -INF, -2.0, 0.5], [1.0, 2.0, 3.0, 4.0]],
                     device=DEVICE)
    w = torch.randint(-127, 128, (3, 4), generator=torch.Generator().manual_seed(0),
                      dtype=torch.int8).to(DEVICE)
    q, s = per_token_quant(x, torch.int8)
    out = int8_scaled_mm(q, s, w, torch.ones(3, device=DEVICE), torch.float32)
    assert not torch.isfinite(out[:2]).any() and torch.isfinite(out[2]).all()


@pytest.mark.parametrize("m,n,k", [(1, 5, 33), (17, 9, 100), (3, 40, 1)])
def test_gemm_k_not_multiple_of_blocks(m, n, k):
    from pagebatch.quant.kernels.int8_gemm import int8_scaled_mm

    g = torch.Generator().manual_seed(m + n + k)
    xq = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8).to(DEVICE)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    base = torch.zeros(m, 2 * k, dtype=torch.int8, device=DEVICE)
    base[:, :k] = xq
    out = int8_scaled_mm(base[:, :k], torch.ones(m, 1, device=DEVICE), w,
                         torch.ones(n, device=DEVICE), torch.float32, block_k=32)
    assert torch.equal(out, xq.float() @ w.float().t())


# ---- NaN --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_nan_inputs_give_nan_scales(kind):
    """A row with a NaN gets a NaN scale, as the torch formula gives (``tl.maximum`` and the
    ``tl.max`` reduction ignore NaN, so per_token_quant.py carries it in a ``x * 0`` sum):
    an upstream overflow is not turned into finite garbage on GPUs only."""
    from pagebatch.quant.int8 import quantize_per_token
    from pagebatch.quant.kernels.per_token_quant import per_token_quant

    out_dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    ref_fn = quantize_per_token if kind == "int8" else _fp8_reference
    x = torch.tensor([[1.0, NAN, -2.0, 0.5], [NAN, NAN, NAN, NAN]], device=DEVICE)
    q, s = per_token_quant(x, out_dtype)
    _, rs = _cpu(ref_fn, x)
    assert torch.isnan(rs).all()  # the torch formula
    assert torch.isnan(s).all(), (s.flatten().tolist(), q.float().tolist())
