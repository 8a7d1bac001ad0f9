"""The 16-bit batch-1 GEMV (core/kernels/gemv.py) against ``F.linear``: masked N and K edges,
bias, split-K through the last-arriving program (core/kernels/splitk.py). With CUDA the kernel
runs compiled (bf16, fp16); on the CPU under ``TRITON_INTERPRET=1`` in a child process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interpreted import (DEVICE, DTYPES, IN_PROCESS, ON_GPU, REL_TOL,  # noqa: F401
                         kernels_run_here, rel_err, run_under_interpreter)


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=300)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("m,n,k,block_n,block_k,split_k,bias", [
    (1, 64, 256, 32, 64, 1, False), (1, 50, 200, 16, 64, 3, True),
    (3, 33, 96, 32, 32, 2, True), (2, 8, 64, 16, 32, 8, False),
    (1, 64, 512, 16, 64, 3, True)])  # K, N multiples of the tile: unmasked; 8 tiles in 3 splits
def test_gemv_equals_linear(m, n, k, block_n, block_k, split_k, bias, dtype, prefetch):
    from pagebatch.kernels.gemv import gemv
    from pagebatch.kernels.splitk import counter_buffer

    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    for _ in range(2):  # the second launch reuses the counters the first left at zero
        out = gemv(x, w, b, block_n=block_n, block_k=block_k, split_k=split_k,
                   prefetch=prefetch)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, ref) < REL_TOL[dtype]
    assert not counter_buffer(x.device).any()


def test_gemv_errors():
    from pagebatch.kernels.gemv import gemv

    x = torch.randn(1, 32, device=DEVICE)
    w = torch.randn(16, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"\(1, 32\) and weight \(16, 31\)"):
        gemv(x, w[:, :31], block_n=16, block_k=32)
    with pytest.raises(ValueError, match="unit stride along K"):
        gemv(x, torch.randn(32, 16, device=DEVICE).t(), block_n=16, block_k=32)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.zeros(15, device=DEVICE), block_n=16, block_k=32)


def test_dense_linear_without_a_table_is_f_linear():
    """No tuned table entry (the CPU; shapes never tuned): exactly F.linear."""
    from pagebatch.layers.dense import dense_linear

    x, w, b = torch.randn(2, 24), torch.randn(8, 24), torch.randn(8)
    assert torch.equal(dense_linear(x, w, b), F.linear(x, w, b))


def test_dense_table_choice(tmp_path, monkeypatch):
    """core/layers/dense.py asks the ``dense_gemv`` table once per (device, N, K, M): the GEMV's
    parameters where the sweep measured it faster, None (cuBLAS) where cuBLAS won or nothing
    was measured."""
    import json

    from pagebatch.kernels import tuned
    from pagebatch.layers import dense

    table = {dense.gemv_key(64, 32): {"1": {"kernel": "gemv", "block_n": 16, "block_k": 32},
                                      "2": {"kernel": "cublas"}}}
    (tmp_path / "dense_gemv_Fake_GPU.json").write_text(json.dumps(table))
    monkeypatch.setenv(tuned.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(tuned, "_device_name", lambda index: "Fake_GPU")
    tuned.load_table.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        assert dense._lookup(cuda, 64, 32, 1) == {"block_n": 16, "block_k": 32}
        assert dense._lookup(cuda, 64, 32, 2) is None  # cuBLAS won
        assert dense._lookup(cuda, 64, 32, 3) is None  # not measured
        assert dense._lookup(cuda, 128, 32, 1) is None
    finally:
        tuned.load_table.cache_clear()
