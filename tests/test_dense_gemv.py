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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k,block_n,block_k,split_k,bias", [
    (1, 64, 256, 16, 64, 1, False),   # 2 x 32 rows, 8 outputs per tile: unmasked
    (2, 50, 200, 8, 64, 3, True),     # 25 outputs: the last tile half out of range
    (3, 96, 512, 32, 128, 4, False),  # split-K through the gated epilogue
    (1, 40, 96, 64, 32, 2, True)])    # one tile wider than the outputs (20 < 32)
def test_gated_gemv_is_silu_mul_of_the_product(m, n, k, block_n, block_k, split_k, bias,
                                               dtype):
    """``gated=True``: W's rows are N/2 gate then N/2 up ones and the GEMV's epilogue stores
    silu(gate) * up ``[M, N/2]`` (Llama's MLP at decode sizes: no activation kernel)."""
    from pagebatch.kernels.gemv import gemv
    from pagebatch.kernels.splitk import counter_buffer
    from pagebatch.layers.activation import silu_and_mul_torch

    g = torch.Generator().manual_seed(3 * n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    ref = silu_and_mul_torch(F.linear(x.double(), w.double(),
                                      None if b is None else b.double()))
    for _ in range(2):
        out = gemv(x, w, b, block_n=block_n, block_k=block_k, split_k=split_k, gated=True)
        assert out.dtype == dtype and out.shape == (m, n // 2)
        assert rel_err(out, ref) < 2 * REL_TOL[dtype]
    assert not counter_buffer(x.device).any()
    with pytest.raises(ValueError, match=f"N={n - 1} is odd"):
        gemv(x, w[:-1], block_n=block_n, block_k=block_k, gated=True)


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
    """core/layers/dense.py asks for the ``dense_gemv`` config once per (device, N, K, M): the
    GEMV's parameters where a table measured it faster, None (cuBLAS) where cuBLAS won; for a
    row count or shape no table has, the rule's (core/kernels/gemv_configs.py: the GEMV at one
    row, cuBLAS above)."""
    import json

    from pagebatch.kernels import gemv_configs, tuned
    from pagebatch.layers import dense

    table = {dense.gemv_key(64, 32): {"1": {"kernel": "gemv", "block_n": 16, "block_k": 32},
                                      "2": {"kernel": "cublas"}}}
    (tmp_path / "dense_gemv_Fake_GPU.json").write_text(json.dumps(table))
    monkeypatch.setenv(tuned.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(tuned.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(tuned, "_device_name", lambda index: "Fake_GPU")
    dense._modules()
    monkeypatch.setitem(dense._kernels, "num_sms", lambda device: 8)
    tuned.clear_caches()
    try:
        cuda = torch.device("cuda", 0)
        assert dense._lookup(cuda, 64, 32, 1) == {"block_n": 16, "block_k": 32}
        assert dense._lookup(cuda, 64, 32, 2) is None  # cuBLAS won
        assert dense._lookup(cuda, 64, 32, 3) is None  # not measured: the rule, cuBLAS
        rule = gemv_configs.rule_config(1, 128, 32, 8)
        assert dense._lookup(cuda, 128, 32, 1) == {p: v for p, v in rule.items()
                                                   if p != "kernel"}
    finally:
        tuned.clear_caches()


@pytest.mark.skipif(not ON_GPU, reason="the engine on CUDA")
def test_engine_greedy_with_the_gemv_table_is_cublas_greedy(tmp_path, monkeypatch):
    """GPU: batch-1 greedy decode of a tiny bf16 Llama with a ``dense_gemv`` table that picks
    the GEMV for every linear layer (gate/up through the gated epilogue, no activation kernel)
    gives the tokens of the same engine on cuBLAS (near-tie rule)."""
    import json

    from conftest import build_tiny_model
    from numerics import assert_greedy_match, greedy_one_by_one
    from pagebatch import LLM, SamplingParams
    from pagebatch.kernels import tuned
    from pagebatch.layers import dense

    hidden, inter, heads, kv_heads, vocab = 256, 512, 8, 2, 512
    folder = build_tiny_model(tmp_path / "tiny", hidden_size=hidden, intermediate_size=inter,
                              num_attention_heads=heads, num_key_value_heads=kv_heads,
                              vocab_size=vocab, max_position_embeddings=512)
    hd = hidden // heads
    shapes = [((heads + 2 * kv_heads) * hd, hidden), (hidden, hidden), (2 * inter, hidden),
              (hidden, inter), (vocab, hidden)]
    cfg = {"kernel": "gemv", "block_n": 16, "block_k": 128, "split_k": 2, "num_warps": 4}
    table = {dense.gemv_key(n, k): {"1": cfg} for n, k in shapes}
    (tmp_path / f"dense_gemv_{tuned.device_name(torch.device('cuda'))}.json").write_text(
        json.dumps(table))
    prompts = [[(7 * i + j) % (vocab - 3) + 3 for j in range(5 + 9 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cublas_dir = tmp_path / "cublas"  # the baseline: a table that says cuBLAS everywhere
    cublas_dir.mkdir()
    (cublas_dir / f"dense_gemv_{tuned.device_name(torch.device('cuda'))}.json").write_text(
        json.dumps({dense.gemv_key(n, k): {"16": {"kernel": "cublas"}} for n, k in shapes}))
    runs = {}
    for with_table in (False, True):
        monkeypatch.setenv(tuned.ENV_DIR, str(tmp_path if with_table else cublas_dir))
        tuned.clear_caches()
        dense._choice.clear()
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", num_kv_blocks=256,
                  block_size=16, max_num_seqs=1)
        runs[with_table] = greedy_one_by_one(llm, prompts, sp)
        gate_up = (torch.device("cuda", torch.cuda.current_device()), 2 * inter, hidden, 1,
                   True)
        assert (dense._choice.get(gate_up) is not None) == with_table
        del llm
        torch.cuda.empty_cache()
    tuned.clear_caches()
    dense._choice.clear()
    for ref, gaps, got in zip(runs[False][0], runs[False][1], runs[True][0]):
        assert_greedy_match(ref, gaps, got, what="GEMV table vs cuBLAS")
