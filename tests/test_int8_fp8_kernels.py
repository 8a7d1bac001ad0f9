"""The W8A8 Triton kernels (quant/kernels/per_token_quant.py, quant/kernels/int8_gemm.py)
against the torch formulas they replace: per-token quantization bit for bit (int8 and fp8
e4m3, ties included), the int8 GEMM's int32 sums exactly and its scaled output to rounding.
With CUDA they run compiled; on the CPU under ``TRITON_INTERPRET=1`` (tiny shapes) in a child
process (tests/interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from pagebatch.quant.int8 import quantize_per_token

from interpreted import (DEVICE, IN_PROCESS, ON_GPU, kernels_run_here,  # noqa: F401
                         rel_err, run_under_interpreter)

X_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=300)


def _fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quant/fp8.py's former torch formula (per-token absmax / 448, clamp, cast)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _cpu_ref(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x)`` computed on the CPU, where torch divides by a scalar exactly (on CUDA it
    multiplies by the reciprocal, which can differ by one ulp), moved to x's device."""
    q, s = fn(x.cpu())
    return q.to(x.device), s.to(x.device)


def _rows(k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of different magnitudes, one all zeros (with -0.0), one far below eps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, k, generator=g)
    mag = torch.tensor([1.0, 0.0, 1e-3, 300.0, 1e-11, 0.02])[:, None]
    return (x * mag).to(dtype).to(DEVICE)


def _assert_same_bits(q: torch.Tensor, ref: torch.Tensor):
    assert q.dtype == ref.dtype and q.shape == ref.shape
    a, b = q.view(torch.uint8), ref.view(torch.uint8)
    bad = (a != b).nonzero()
    first = tuple(bad[0]) if bad.numel() else None
    assert first is None, (bad[:5].tolist(), q[first].float(), ref[first].float())


@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("k,block", [(1, 16), (100, 32), (257, 64), (64, 64)])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_per_token_quant_equals_torch(kind, k, block, dtype):
    """K smaller than, a multiple of and not a multiple of BLOCK (several chunks per row)."""
    from pagebatch.quant.kernels.per_token_quant import per_token_quant

    x = _rows(k, dtype, seed=k)
    out_dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    q, s = per_token_quant(x, out_dtype, block=block)
    rq, rs = _cpu_ref(quantize_per_token if kind == "int8" else _fp8_reference, x)
    assert s.shape == (6, 1) and s.dtype == torch.float32 and torch.equal(s, rs)
    _assert_same_bits(q, rq)
    assert torch.all(q[1].float() == 0)  # the zero row
    if kind == "int8":
        assert int(q.abs().max()) == 127


def test_per_token_quant_ties_round_half_to_even():
    """Values exactly halfway between two levels (scale exactly 1: absmax 127 / 448)."""
    from pagebatch.quant.kernels.per_token_quant import per_token_quant

    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -3.5, 126.5, -125.5, 1.4999999]],
                     device=DEVICE)
    q, _ = per_token_quant(x, torch.int8)
    _assert_same_bits(q, _cpu_ref(quantize_per_token, x)[0])
    assert q[0, 1:8].tolist() == [0, 2, 2, 0, -4, 126, -126]
    # e4m3 ties: 17 (16|18), 19 (18|20), 124 (120|128), 232 (224|240), 1.5 * 2**-9 (subnormal)
    x = torch.tensor([[448.0, 17.0, 19.0, 124.0, -232.0, 1.5 * 2**-9, 2.5 * 2**-9, -2**-11]],
                     device=DEVICE)
    q, _ = per_token_quant(x, torch.float8_e4m3fn)
    _assert_same_bits(q, _cpu_ref(_fp8_reference, x)[0])
    assert q.float()[0, 1:7].tolist() == [16.0, 20.0, 128.0, -224.0, 2**-8, 2**-8]


def test_per_token_quant_strided_rows_and_errors():
    from pagebatch.quant.kernels.per_token_quant import per_token_quant

    base = _rows(96, torch.float16)
    x = base[:, 16:80]  # row stride 96, unit stride along K
    q, s = per_token_quant(x, torch.int8, block=32)
    rq, rs = _cpu_ref(quantize_per_token, x)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    with pytest.raises(ValueError, match="out_dtype"):
        per_token_quant(x, torch.float16)
    with pytest.raises(ValueError, match="stride"):
        per_token_quant(base.t(), torch.int8)
    with pytest.raises(ValueError, match=r"shape \(96,\)"):
        per_token_quant(base[0], torch.int8)


def _int8_problem(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    xq = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    xs = torch.rand(m, 1, generator=g) * 0.02 + 1e-3
    ws = torch.rand(n, generator=g) * 0.02 + 1e-3
    bias = torch.randn(n, generator=g)
    return [t.to(DEVICE) for t in (xq, xs, w, ws, bias)]


# M, N, K not multiples of the blocks; EVEN_K (K = 64) and masked K; several GROUP_M groups
GEMM_CASES = [(1, 24, 40, 16, 16, 32, 4), (37, 50, 96, 16, 32, 32, 2),
              (70, 33, 64, 32, 16, 32, 1), (45, 81, 20, 16, 32, 32, 3)]


@pytest.mark.parametrize("m,n,k,bm,bn,bk,gm", GEMM_CASES)
def test_int8_gemm_sums_exact(m, n, k, bm, bn, bk, gm):
    """Unit scales and fp32 output: the int32 sums themselves (exact in fp32 here)."""
    from pagebatch.quant.kernels.int8_gemm import int8_scaled_mm

    xq, _, w, _, _ = _int8_problem(m, n, k)
    out = int8_scaled_mm(xq, torch.ones(m, 1, device=DEVICE), w, torch.ones(n, device=DEVICE),
                         torch.float32, block_m=bm, block_n=bn, block_k=bk, group_m=gm)
    assert torch.equal(out, xq.float() @ w.float().t())


@pytest.mark.parametrize("out_dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n,k,bm,bn,bk,gm", GEMM_CASES[1:3])
def test_int8_gemm_scaled_output(m, n, k, bm, bn, bk, gm, with_bias, out_dtype):
    from pagebatch.quant.kernels.int8_gemm import int8_scaled_mm

    xq, xs, w, ws, bias = _int8_problem(m, n, k, seed=1)
    b = bias.to(out_dtype) if with_bias else None
    out = int8_scaled_mm(xq, xs, w, ws, out_dtype, b, block_m=bm, block_n=bn, block_k=bk,
                         group_m=gm)
    ref = (xq.float() @ w.float().t()) * xs * ws
    if with_bias:
        ref = ref + b.float()
    assert out.dtype == out_dtype and out.shape == (m, n)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out_dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_int8_gemm_default_config_and_errors():
    from pagebatch.quant.kernels.int8_gemm import int8_scaled_mm, pick_int8_config

    assert pick_int8_config(1, 4096, 4096)["block_m"] == 16
    assert pick_int8_config(2048, 4096, 4096)["block_m"] >= 64  # wgmma-sized tiles
    xq, xs, w, ws, _ = _int8_problem(3, 20, 32)
    out = int8_scaled_mm(xq, xs, w, ws, torch.float32)  # pick_int8_config's tiles
    assert rel_err(out, (xq.float() @ w.float().t()) * xs * ws) < 1e-6
    with pytest.raises(ValueError, match="w_scale"):
        int8_scaled_mm(xq, xs, w, ws[:5], torch.float32)
    with pytest.raises(ValueError, match=r"\(20, 16\)"):
        int8_scaled_mm(xq, xs, w[:, :16], ws, torch.float32)
    with pytest.raises(ValueError, match="torch.int8"):
        int8_scaled_mm(xq.float(), xs, w, ws, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        int8_scaled_mm(xq, xs, w, ws, torch.int32)
    with pytest.raises(ValueError, match="block_k=16 is below 32"):
        int8_scaled_mm(xq, xs, w, ws, torch.float32, block_k=16)


def test_w8a8_pipeline_equals_torch_reference():
    """per_token_quant -> int8_scaled_mm equals quantize_per_token -> float GEMM (the CPU path
    of quant/int8.py), the whole W8A8 product."""
    from pagebatch.quant.kernels.int8_gemm import int8_scaled_mm
    from pagebatch.quant.kernels.per_token_quant import per_token_quant
    from pagebatch.quant.packing import quantize_int8_per_channel

    g = torch.Generator().manual_seed(3)
    x = torch.randn(19, 72, generator=g).to(DEVICE)
    wq, ws = quantize_int8_per_channel(torch.randn(40, 72, generator=g).to(DEVICE) * 0.1)
    xq, xs = per_token_quant(x, torch.int8, block=32)
    out = int8_scaled_mm(xq, xs, wq, ws, torch.float32, block_m=16, block_n=16, block_k=32)
    rq, rs = _cpu_ref(quantize_per_token, x)
    ref = (rq.float() @ wq.float().t()) * rs * ws
    assert rel_err(out, ref) < 1e-6


@pytest.mark.skipif(not ON_GPU, reason="whole layers run the kernels only on CUDA")
@pytest.mark.parametrize("m", [1, 16, 100, 1000])
def test_int8_layer_apply_on_gpu(m):
    from pagebatch.layers.linear import LinearBase
    from pagebatch.quant.int8 import Int8Method

    k, n = 4096, 1024 + 8
    method = Int8Method(None, None)
    layer = LinearBase(k, [n], True, method, torch.bfloat16, DEVICE)
    layer.load("weight", (torch.randn(n, k, device=DEVICE) * 0.05).bfloat16(), None)
    layer.load("bias", torch.randn(n, device=DEVICE).bfloat16(), None)
    method.process_weights_after_loading(layer)
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    xq, xs = quantize_per_token(x)
    ref = (xq.double() @ layer.weight.double().t()) * xs.double() * layer.weight_scale.double()
    ref = ref + layer.bias.double()
    assert rel_err(layer(x), ref) < 5e-3
