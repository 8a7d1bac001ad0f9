"""The greedy sampler's row-wise argmax (core/kernels/argmax.py) against torch.argmax: ties
across and inside programs (first index), NaN (the first NaN), rows of -inf, vocabularies that
do and do not fill the last program, bf16 input, several rows; counters left at zero. With CUDA
the kernel runs compiled; on the CPU under ``TRITON_INTERPRET=1`` in a child process. Also
(GPU): the sampler's greedy and random paths give the same tokens through it as through torch."""

from __future__ import annotations

import pytest
import torch

from interpreted import (DEVICE, IN_PROCESS, ON_GPU, kernels_run_here,  # noqa: F401
                         run_under_interpreter)


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=300)


@pytest.mark.parametrize("n,v", [(1, 100), (3, 5000), (2, 128256), (4, 1), (5, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_argmax_rows_equals_torch(n, v, dtype):
    from pagebatch.kernels.argmax import argmax_rows
    from pagebatch.kernels.splitk import counter_buffer

    g = torch.Generator().manual_seed(n * v)
    x = torch.randn(n, v, generator=g).to(dtype)
    if v > 10:
        x[0, v // 3] = x[0, v - 2] = 50.0  # a tie far apart: the first
        if n > 1:
            x[-1, 1] = x[-1, 2] = 60.0  # a tie next to each other
    x = x.to(DEVICE)
    for _ in range(2):  # the counters are reused
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert not counter_buffer(x.device).any()


def test_argmax_rows_nan_and_inf():
    from pagebatch.kernels.argmax import argmax_rows

    x = torch.randn(4, 9000)
    x[0] = float("-inf")  # torch: 0
    x[1, 7000] = x[1, 8500] = float("nan")  # the first NaN
    x[2, 12] = float("inf")
    x[3, 8999] = float("nan")
    x = x.to(DEVICE)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.skipif(not ON_GPU, reason="the sampler takes the kernel on CUDA only")
def test_sampler_through_the_kernel_matches_torch(monkeypatch):
    """The sampler on CUDA uses it; the same tokens as torch's argmax."""
    from pagebatch import sampler as sm

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 3000, generator=g).to(DEVICE)
    batch = sm.SamplingBatch(
        temperature=torch.tensor([0.0, 0.7, 1.3], device=DEVICE), top_k=None, top_p=None,
        seeds=torch.tensor([1, 2, 3], device=DEVICE),
        positions=torch.tensor([4, 5, 6], device=DEVICE), all_greedy=False, any_top_k=False,
        any_top_p=False)
    from pagebatch.kernels import argmax as kernel

    calls = []
    argmax_rows = kernel.argmax_rows
    monkeypatch.setattr(kernel, "argmax_rows", lambda x: (calls.append(1), argmax_rows(x))[1])
    got = sm.sample(logits, batch)
    assert len(calls) == 2  # the greedy rows' argmax and the draw's
    monkeypatch.setattr(sm, "_argmax", lambda x: x.argmax(dim=-1))
    assert torch.equal(got, sm.sample(logits, batch))
