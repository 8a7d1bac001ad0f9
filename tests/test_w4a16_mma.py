"""The tensor-core W4A16 product (quant/kernels/w4a16_mma.py): the mma layout round trip, the
kernel against the fp64 product of the stored values (decode with split-K and the gated
epilogue, prefill tiles, masked N), and its input checks. On the CPU the kernels run under
``TRITON_INTERPRET=1`` in a child process with the inline assembly replaced by the same
arithmetic (tests/interpreted.py); on a GPU the assembly runs, in bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import (DEVICE, ON_GPU, kernels_run_here,  # noqa: F401
                         run_under_interpreter)

DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=600)


def _problem(m, n, k, gs, dtype, *, seed=0, x_mean=0.0):
    """Canonical tensors from random 4-bit fields and integer zeros, x, and the fp64 reference
    of x @ W^T from the stored values."""
    from pagebatch.quant.packing import pack_fields

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    z = torch.randint(0, 16, (k // gs, n), generator=g).float()
    s = torch.rand(k // gs, n, generator=g) * 0.05 + 0.005
    x = torch.randn(m, k, generator=g) + x_mean
    x, s, z = x.to(dtype), s.to(dtype), z.to(dtype)
    rows = torch.arange(k) // gs
    ref = x.double() @ ((q.double() - z.double()[rows]) * s.double()[rows])
    return [t.to(DEVICE) for t in (x, pack_fields(q, 4, dim=0), s, z)] + [ref]


def _rel(out, ref):
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


# m, n, k, group, block_n, block_k, block_m, split_k
CASES = [
    (1, 64, 256, 128, 32, 128, 16, 1),
    (1, 80, 512, 64, 32, 64, 16, 4),     # N not a multiple of the tile, split-K
    (3, 64, 384, 128, 64, 32, 16, 5),    # 12 K tiles over 5 splits (one split empty)
    (16, 32, 256, 256, 32, 64, 16, 2),   # a full column tile of rows
    (40, 48, 256, 64, 32, 64, 16, 1),    # prefill: three M tiles, the last partial
    (20, 64, 128, 128, 64, 128, 32, 1),  # prefill with a wider M tile
]


@pytest.mark.parametrize("m,n,k,gs,block_n,block_k,block_m,split_k", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mma_matches_fp64(m, n, k, gs, block_n, block_k, block_m, split_k, dtype):
    """Within the output rounding of the fp64 product, twice (the split-K counters are reused
    and left at zero)."""
    from pagebatch.kernels.splitk import counter_buffer
    from pagebatch.quant.kernels.w4a16_mma import w4a16_mma

    x, qw, s, z, ref = _problem(m, n, k, gs, dtype, seed=m + n + k)
    qm = qw
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    for _ in range(2):
        out = w4a16_mma(x, qm, s, z, gs, block_n=block_n, block_k=block_k, block_m=block_m,
                        split_k=split_k)
        assert out.shape == (m, n) and out.dtype == dtype
        assert _rel(out, ref) < tol
    assert not counter_buffer(DEVICE).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mma_nonzero_mean_activations(dtype):
    """Activations far from zero mean stay within output rounding (the group sums of x are
    never subtracted: the zero point is taken out of each weight exactly)."""
    from pagebatch.quant.kernels.w4a16_mma import w4a16_mma

    x, qw, s, z, ref = _problem(2, 64, 512, 128, dtype, x_mean=30.0, seed=3)
    out = w4a16_mma(x, qw, s, z, 128, block_n=32, block_k=128, split_k=2)
    assert _rel(out, ref) < (8e-3 if dtype == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("m,split_k", [(1, 1), (2, 4)])
def test_mma_gated_is_silu_mul_of_the_product(m, split_k):
    from pagebatch.layers.activation import silu_and_mul_torch
    from pagebatch.quant.kernels.w4a16_mma import w4a16_mma

    dtype = DTYPES[0]
    x, qw, s, z, ref = _problem(m, 96, 256, 64, dtype, seed=7)
    f = 3 / ref.std().item()
    want = silu_and_mul_torch(ref * f)
    out = w4a16_mma(x, qw, s * f, z, 64, block_n=32, block_k=64, split_k=split_k,
                    gated=True)
    assert out.shape == (m, 48)
    assert _rel(out, want) < (2e-2 if dtype == torch.bfloat16 else 3e-3)


def test_bad_inputs_raise_value_error():
    from pagebatch.quant.kernels.w4a16_mma import w4a16_mma

    x, qw, s, z, _ = _problem(1, 32, 256, 128, torch.float16)
    qm = qw
    with pytest.raises(ValueError, match="block_k=48"):
        w4a16_mma(x, qm, s, z, 128, block_k=48)
    with pytest.raises(ValueError, match="group size 64"):
        w4a16_mma(x, qm, s, z, 64, block_k=128)
    with pytest.raises(ValueError, match="K=128"):
        w4a16_mma(x[:, :128], qm, s, z, 128)
    with pytest.raises(ValueError, match="2-D bf16/fp16"):
        w4a16_mma(x.float(), qm, s, z, 128)
    with pytest.raises(ValueError, match="M=40 rows exceed block_m=16"):
        w4a16_mma(x.expand(40, -1), qm, s, z, 128, split_k=2)
