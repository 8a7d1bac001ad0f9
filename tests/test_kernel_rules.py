"""Every config the launch rules give the autotuner (core/kernels/gemv_configs.py for the 16-bit
GEMV, quant/kernels/wna16_configs.py for W4A16 / W8A16) is a valid launch whose result matches
torch, on shapes no table has: Qwen2.5-7B's (hidden 3584, intermediate 18944, 28 / 4 heads of
128) scaled down, N and K not powers of two, and their tensor-parallel shards (N or K halved),
at 1 and 3 rows, on a small GPU (8 SMs: split-K everywhere) and an H200's 132. With CUDA the kernels
run compiled; on the CPU under ``TRITON_INTERPRET=1`` in a child process (fp16 / fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interpreted import (DEVICE, DTYPES, IN_PROCESS, ON_GPU, REL_TOL,  # noqa: F401
                         kernels_run_here, rel_err, run_under_interpreter)

# Qwen2.5-7B / 64: hidden 56, intermediate 296, q + 2 kv heads' rows 72; TP=2 shards
DENSE_SHAPES = [  # (N, K, gated): qkv, down; the TP=2 shards of o and gate_up
    (72, 56, False), (56, 296, False), (56, 28, False), (296, 56, True)]
# Qwen2.5-7B / 16 where K must hold whole groups of 32: hidden 224, intermediate 288; qkv,
# down, the TP=2 shards of qkv and gate_up
WNA16_SHAPES = [(72, 224, False), (56, 288, False), (36, 224, False), (288, 224, True)]


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=900)


@pytest.mark.parametrize("sms", [8])
@pytest.mark.parametrize("n,k,gated", DENSE_SHAPES)
def test_dense_rule_candidates_run(n, k, gated, sms, monkeypatch):
    from pagebatch.kernels import gemv_configs
    from pagebatch.kernels.gemv import gemv
    from pagebatch.layers.activation import silu_and_mul_torch

    dtype = DTYPES[0]
    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE) if n % 3 == 0 else None
    for big_n in (gemv_configs.BIG_N, 64) if gated else (gemv_configs.BIG_N,):
        monkeypatch.setattr(gemv_configs, "BIG_N", big_n)  # both branches of the tile choice
        for m in (1, 3):
            x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            ref = silu_and_mul_torch(ref) if gated else ref
            cands = gemv_configs.candidates(m, n, k, sms, gated)
            assert cands[0] == gemv_configs.rule_config(m, n, k, sms, gated) or m > 1
            for cfg in cands:
                if cfg["kernel"] == "cublas":
                    continue
                params = {p: v for p, v in cfg.items() if p != "kernel"}
                out = gemv(x, w, bias, gated=gated, **params)
                assert rel_err(out, ref) < 2 * REL_TOL[dtype], (n, k, m, cfg)


@pytest.mark.parametrize("n,k,gated,sms,bits", [(*s, 8, 4) for s in WNA16_SHAPES] + [
    (*WNA16_SHAPES[0], 132, 4), (*WNA16_SHAPES[0], 8, 8)])
def test_wna16_rule_candidates_run(n, k, gated, sms, bits):
    """The GEMV (with fp16x2 fields for 4 bits and 16-bit activations) at one row, the
    tensor-core kernel at 2-3 rows (4 bits, 16-bit activations), the split-K GEMM else."""
    from test_wna16_gemv_edges import _problem, _rel

    from pagebatch.kernels.activation import silu_and_mul
    from pagebatch.layers.activation import silu_and_mul_torch
    from pagebatch.quant.kernels import wna16, wna16_configs

    dtype = DTYPES[0]
    act16 = dtype in (torch.float16, torch.bfloat16)
    for m in (1, 3):
        x, qw, s, z, ref = _problem(m, n, k, bits, 32, dtype=dtype, seed=n + k + m)
        ref = silu_and_mul_torch(ref) if gated else ref
        cands = wna16_configs.candidates(m, n, k, 32, False, sms, bits, act16)
        kinds = {c["kernel"] for c in cands}
        assert kinds == ({"gemv"} if m == 1 else {"mma"} if act16 and bits == 4 else {"gemm"})
        for cfg in cands:
            out = wna16.run_config(x, qw, s, z, bits, 32, None, cfg, gated=gated)
            if out is None:  # the GEMM has no gated epilogue
                out = silu_and_mul(wna16.run_config(x, qw, s, z, bits, 32, None, cfg))
            assert _rel(out, ref) < 5e-3, (n, k, m, bits, cfg)


def test_rule_picks_what_the_h200_tables_measured():
    """On the 8B shapes (132 SMs) the rules give the packaged tables' choices where those are
    the rule's kind (the tables are the evidence of the rules: module docstrings)."""
    from pagebatch.kernels.gemv_configs import rule_config
    from pagebatch.quant.kernels.wna16_configs import rule_config as w4_rule

    assert rule_config(1, 4096, 4096, 132) == dict(kernel="gemv", block_n=8, block_k=512,
                                                   split_k=1, prefetch=0, num_warps=8,
                                                   num_stages=3)
    assert rule_config(1, 28672, 4096, 132, gated=True)["block_n"] == 16
    assert rule_config(2, 4096, 4096, 132)["kernel"] == "cublas"
    split = {(n, k): w4_rule(1, n, k, 128, False, 132, 4, True)["split_k"]
             for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))}
    # (the table's 12 splits of 32 K tiles run 3 tiles each, as 11 do: its 12th is empty)
    assert split == {(6144, 4096): 11, (4096, 4096): 16, (28672, 4096): 4, (4096, 14336): 16}
    one = w4_rule(1, 4096, 4096, 128, False, 132, 4, True)
    assert one["half2"] == 1 and one["prefetch"] == 1 and one["num_warps"] == 4
    assert w4_rule(1, 28672, 4096, 128, False, 132, 4, True)["num_warps"] == 2
    mma = w4_rule(8, 4096, 4096, 128, False, 132, 4, True)
    assert (mma["kernel"], mma["block_n"], mma["split_k"], mma["num_warps"]) == ("mma", 128, 8, 8)
    assert w4_rule(8, 4096, 4096, 128, False, 132, 4, False)["kernel"] == "gemm"  # fp32 x
