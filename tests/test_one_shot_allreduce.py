"""The one-shot all-reduce kernel (core/kernels/allreduce.py) on the CPU: the W "ranks" are
processes under TRITON_INTERPRET=1 (children of the interpreter child, tests/interpreted.py),
their buffers and signal arrays shared-memory tensors whose addresses every rank gets, as
symmetric memory gives them on GPUs. This checks the protocol (slots, flags, epochs,
rank-order sums, the fused residual + RMSNorm) and its results; the memory ordering across GPUs
is the GPU's to show (tests/test_parallel_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from interpreted import (IN_PROCESS, kernels_run_here,  # noqa: F401
                         run_under_interpreter)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the thread-ranks run on the CPU only")


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=300)


def _rank(rank, world, max_rows, hidden, bufs, sigs):
    """Rank ``rank``'s all-reduce over the shared ``bufs`` / ``sigs`` tensors, at the addresses
    this process sees them at."""
    from pagebatch.kernels.allreduce import OneShotAllReduce

    return OneShotAllReduce(bufs[rank], [b.data_ptr() for b in bufs],
                            [s.data_ptr() for s in sigs], rank, world, max_rows, hidden,
                            keepalive=(bufs, sigs))


def _rank_process(rank, world, max_rows, hidden, dtype, bufs, sigs, jobs, outs, epochs):
    """One rank (a process of its own: the Triton interpreter is not thread-safe): run
    ``jobs`` (("sum", x) or ("norm", x, residual, weight)) in order, writing each result into
    the shared ``outs`` and the final epochs into ``epochs``."""
    ar = _rank(rank, world, max_rows, hidden, bufs, sigs)
    for j, job in enumerate(jobs):
        x = job[1][rank]
        if job[0] == "sum":
            outs[j][0][:x.shape[0]] = ar.all_reduce(x)
        else:
            out, res = ar.all_reduce_add_rms_norm(x, job[2], job[3], 1e-6)
            outs[j][0][:x.shape[0]], outs[j][1][:x.shape[0]] = out, res
    epochs[rank] = ar.epochs


def _run_ranks(world, max_rows, hidden, dtype, jobs):
    """Every rank in its own process over shared buffers; per rank, per job, (out, res)."""
    import torch.multiprocessing as mp

    bufs = [torch.full((2 * max_rows * hidden,), float("nan"), dtype=dtype).share_memory_()
            for _ in range(world)]
    sigs = [torch.zeros(max_rows * world, dtype=torch.int64).share_memory_()
            for _ in range(world)]
    outs = [[[torch.zeros(max_rows, hidden, dtype=dtype).share_memory_() for _ in range(2)]
             for _ in jobs] for _ in range(world)]
    epochs = torch.zeros(world, max_rows, dtype=torch.int64).share_memory_()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_process, args=(r, world, max_rows, hidden, dtype, bufs,
                                                     sigs, jobs, outs[r], epochs))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    stuck = [p.is_alive() for p in procs]
    for p in procs:
        p.kill()
    assert not any(stuck), "a rank is stuck waiting for a flag"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return outs, epochs


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_sums_in_rank_order_launch_after_launch(world):
    """Several launches of varying row counts (slots and epochs reused), then the fused
    residual + RMSNorm: every rank gets the fp32 sum in rank order rounded once, the same bits
    on every rank; fused, what the unfused path (the sum, then the norm kernel) gives."""
    from pagebatch.kernels.norm import rms_norm

    hidden = 40
    g = torch.Generator().manual_seed(world)
    jobs = [("sum", [torch.randn(rows, hidden, generator=g).half() for _ in range(world)])
            for rows in (1, 4, 2, 4, 3)]
    residual = torch.randn(3, hidden, generator=g).half()
    weight = (torch.rand(hidden, generator=g) + 0.5).half()
    jobs.append(("norm", [torch.randn(3, hidden, generator=g).half() for _ in range(world)],
                 residual, weight))
    outs, epochs = _run_ranks(world, 4, hidden, torch.float16, jobs)
    for j, job in enumerate(jobs):
        rows = job[1][0].shape[0]
        want = sum(x.float() for x in job[1]).half()
        if job[0] == "norm":
            want, want_res = rms_norm(want, weight, 1e-6, residual)
        for r in range(world):
            assert torch.equal(outs[r][j][0][:rows], want), (r, j)
            if job[0] == "norm":
                assert torch.equal(outs[r][j][1][:rows], want_res), r
    assert torch.equal(epochs, torch.tensor([[6, 5, 4, 2]] * world))


def test_fits_and_bad_setup():
    from pagebatch.kernels.allreduce import OneShotAllReduce

    bufs = [torch.zeros(64, dtype=torch.float16) for _ in range(2)]
    sigs = [torch.zeros(4, dtype=torch.int64) for _ in range(2)]
    r = _rank(0, 2, 2, 16, bufs, sigs)
    assert r.fits(torch.zeros(2, 16, dtype=torch.float16))
    assert not r.fits(torch.zeros(3, 16, dtype=torch.float16))  # more rows than the buffers
    assert not r.fits(torch.zeros(1, 16, dtype=torch.float32))
    assert not r.fits(torch.zeros(0, 16, dtype=torch.float16))
    ptrs, sig_ptrs = [b.data_ptr() for b in bufs], [s.data_ptr() for s in sigs]
    with pytest.raises(ValueError, match="rank 2 outside"):
        OneShotAllReduce(bufs[0], ptrs, sig_ptrs, 2, 2, 2, 16)
    with pytest.raises(ValueError, match="2 ranks need 2 buffer"):
        OneShotAllReduce(bufs[0], ptrs[:1], sig_ptrs, 0, 2, 2, 16)
    with pytest.raises(ValueError, match="is not the one"):
        OneShotAllReduce(bufs[1], ptrs, sig_ptrs, 0, 2, 2, 16)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        OneShotAllReduce(bufs[0], [ptrs[0], ptrs[1] + 2], sig_ptrs, 0, 2, 2, 16)
