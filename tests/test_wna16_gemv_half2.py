"""The batch-1 GEMV's fp16x2 fields (``wna16_gemv(..., half2=True)``, quant/kernels/
wna16_half2.py) against the fp64 product of the dequantized weights (quant/wna16.py
``dequantize_canonical``): group sizes 128 and 64, K past the last full tile (masked loads),
split-K, sub-tiles, prefetch, the gated epilogue, bf16 / fp16 / fp32 activations with a
non-zero mean and magnitudes ~1e3, the range limit ``HALF2_X_MAX``, and the config key
``half2`` through `run_config`. On the CPU the kernels run under ``TRITON_INTERPRET=1`` in a
child process (tests/interpreted.py): the assembly's arithmetic in Triton operations, each
product rounded to fp16 as the HFMA2 rounds it (the assembly itself needs a GPU).

Tolerances (||out - ref|| / ||ref||): every HFMA2 rounds its running sum to fp16 (unit
roundoff u = 2**-11 ~ 4.9e-4), 16 products per half, so the product is off by ~u (measured
4.5e-4 .. 5.5e-4 with fp16 x): 2u = 1e-3 for fp16 and fp32 outputs. bf16 outputs round at
2**-9 (~3e-3 measured on both paths): 6e-3.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import DEVICE, kernels_run_here, run_under_interpreter  # noqa: F401

TOL = {torch.float16: 1e-3, torch.float32: 1e-3, torch.bfloat16: 6e-3}


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=300)


def _problem(m, n, k, gs, dtype, *, x_scale=1.0, x_mean=0.0, centered=False, seed=0):
    """Canonical 4-bit tensors of random fields and integer zero points 0..16 (GPTQ v1's
    range), x, and the fp64 product with ``dequantize_canonical``'s weights (fp64 here)."""
    from pagebatch.quant.packing import pack_fields
    from pagebatch.quant.wna16 import dequantize_canonical

    g = torch.Generator().manual_seed(seed)
    if centered:  # fields around the zero point 8, as RTN / AWQ / GPTQ weights are
        q = (torch.randn(k, n, generator=g) * 16 / 6).round().add(8).clamp(0, 15).int()
        z = torch.full((k // gs, n), 8.0)
    else:
        q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
        z = torch.randint(0, 17, (k // gs, n), generator=g).float()
    s = (torch.rand(k // gs, n, generator=g) * 0.05 + 0.005).to(dtype)
    x = ((torch.randn(m, k, generator=g) + x_mean) * x_scale).to(dtype)
    qw = pack_fields(q, 4, dim=0)
    w = dequantize_canonical(qw, s.double(), z.double(), 4, gs)
    ref = x.double() @ w
    return [t.to(DEVICE) for t in (x, qw, s, z.to(dtype))] + [ref]


def _rel(out, ref):
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


# m, n, k, group, block_n, block_kp, split_k, sub_tiles, prefetch, x dtype, x scale, x mean
CASES = [
    (1, 64, 512, 128, 32, 16, 2, 1, 0, torch.float16, 1.0, 0.0),   # no masks
    (1, 64, 512, 128, 64, 16, 1, 1, 1, torch.bfloat16, 1e3, 0.0),  # |x| up to ~4e3
    (2, 40, 384, 64, 32, 8, 3, 2, 0, torch.float16, 1.0, 2.0),     # masked N, 2nd sub-tile past K
    (1, 32, 320, 64, 32, 4, 4, 1, 1, torch.bfloat16, 1.0, 0.0),    # 10 tiles of 32: split 4
    (1, 48, 256, 128, 32, 8, 2, 2, 1, torch.float32, 30.0, 1.0),   # fp32 x rounded to fp16
]


@pytest.mark.parametrize("m,n,k,gs,block_n,block_kp,split_k,sub,prefetch,dtype,x_scale,x_mean",
                         CASES)
def test_half2_matches_fp64(m, n, k, gs, block_n, block_kp, split_k, sub, prefetch, dtype,
                            x_scale, x_mean):
    """Within fp16-accumulation rounding of the fp64 product (module docstring), twice in a
    row (the split-K counters are reused)."""
    from pagebatch.kernels.splitk import counter_buffer
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, ref = _problem(m, n, k, gs, dtype, x_scale=x_scale, x_mean=x_mean, seed=n + k)
    for _ in range(2):
        out = wna16_gemv(x, qw, s, z, 4, gs, block_n=block_n, block_kp=block_kp,
                         split_k=split_k, sub_tiles=sub, prefetch=prefetch, half2=True)
        assert out.shape == (m, n) and out.dtype == dtype
        assert _rel(out, ref) < TOL[dtype]
    assert not counter_buffer(DEVICE).any()  # the last-arriving programs reset them


def test_half2_nonzero_mean_activations_centered_weights():
    """Weights centered on their zero point and x with a mean of 2 std (the product small
    next to sum(x) * z): the fields enter as v - z, exact, so the error stays at fp16
    accumulation rounding."""
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, ref = _problem(1, 32, 1024, 128, torch.float16, x_mean=2.0, centered=True,
                                seed=3)
    out = wna16_gemv(x, qw, s, z, 4, 128, block_n=32, block_kp=16, split_k=1, half2=True)
    assert _rel(out, ref) < 1e-3


def test_half2_gated_is_silu_mul_of_the_product():
    from pagebatch.layers.activation import silu_and_mul_torch
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, ref = _problem(1, 66, 384, 64, torch.float16, centered=True, seed=5)
    f = 3 / ref.std().item()  # products of std ~3: SiLU far from linear
    want = silu_and_mul_torch(ref * f)
    out = wna16_gemv(x, qw, (s.float() * f).to(s.dtype), z, 4, 64, block_n=16, block_kp=8,
                     split_k=3, gated=True, half2=True)
    assert out.shape == (1, 33)
    assert _rel(out, want) < 2e-3


def test_half2_largest_activations_stay_finite():
    """|x| = HALF2_X_MAX (65504, the largest fp16) with every field 0 and zero point 16: each
    product is x * -16/256, 8 per half reach -32752 and the two halves -65504, still finite
    (within fp16 rounding of the exact sum)."""
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv
    from pagebatch.quant.kernels.wna16_half2 import HALF2_X_MAX
    from pagebatch.quant.packing import pack_fields

    k, n = 128, 32
    qw = pack_fields(torch.zeros(k, n, dtype=torch.int32), 4, dim=0).to(DEVICE)
    z = torch.full((1, n), 16.0, device=DEVICE)
    s = torch.full((1, n), 2.0**-20, device=DEVICE)
    x = torch.full((1, k), HALF2_X_MAX, device=DEVICE)
    out = wna16_gemv(x, qw, s, z, 4, k, block_n=32, block_kp=16, half2=True)
    want = -16 * HALF2_X_MAX * k * 2.0**-20
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double().cpu(), torch.full((1, n), want, dtype=torch.float64),
                          rtol=1e-3)


def test_half2_reads_x_at_an_odd_address():
    """16-bit x is read four inputs at a time (int64): a view 2 bytes into its storage is
    copied first."""
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, ref = _problem(1, 32, 256, 128, torch.float16, seed=7)
    buf = torch.empty(257, dtype=x.dtype, device=DEVICE)
    buf[1:] = x[0]
    out = wna16_gemv(buf[1:].view(1, 256), qw, s, z, 4, 128, block_n=32, block_kp=16,
                     half2=True)
    assert _rel(out, ref) < TOL[torch.float16]
    # two rows 258 apart (the second row 4 bytes off an 8-byte boundary)
    x2, qw, s, z, ref2 = _problem(2, 32, 256, 128, torch.float16, seed=8)
    buf = torch.zeros(2, 258, dtype=x2.dtype, device=DEVICE)
    buf[:, :256] = x2
    out = wna16_gemv(buf[:, :256], qw, s, z, 4, 128, block_n=32, block_kp=16, half2=True)
    assert _rel(out, ref2) < TOL[torch.float16]


def test_run_config_honours_half2():
    """The tuned-table key ``half2`` (0/1) reaches the GEMV: with it the result differs from
    the fp32 path's (fp16 rounding) and is within fp16 accumulation rounding."""
    from pagebatch.quant.kernels import wna16 as W

    x, qw, s, z, ref = _problem(1, 32, 256, 128, torch.float32, seed=9)
    cfg = dict(kernel="gemv", block_n=32, block_kp=16, split_k=2, num_warps=2, num_stages=3)
    plain = W.run_config(x, qw, s, z, 4, 128, None, cfg)
    half = W.run_config(x, qw, s, z, 4, 128, None, {**cfg, "half2": 1})
    assert _rel(plain, ref) < 1e-5 and _rel(half, ref) < TOL[torch.float32]
    assert not torch.equal(plain, half)


def test_half2_rejects_8_bits_and_one_row_tiles():
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, _ = _problem(1, 32, 256, 128, torch.float16)
    with pytest.raises(ValueError, match="half2"):
        wna16_gemv(x, qw, s, z, 4, 128, block_n=32, block_kp=1, half2=True)
    qw8 = torch.zeros(64, 32, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="half2"):
        wna16_gemv(x, qw8, s, z, 8, 128, block_n=32, block_kp=16, half2=True)
