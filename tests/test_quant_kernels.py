"""The W4A16 / W8A16 Triton kernels (quant/kernels/wna16.py) against the dequantized reference.

The canonical tensors come from real AWQ and GPTQ layers (quant methods loading packed
checkpoint tensors), so the repacking at load is covered too. With CUDA the kernels run compiled
(bf16, fp16) and whole layers run through ``apply``; on the CPU they run under
``TRITON_INTERPRET=1`` (fp16, fp32, tiny shapes) in a child process, as in
tests/test_triton_attention.py (the variable must be set before Triton is imported and must not
reach other test modules).
"""

from __future__ import annotations


import pytest
import torch

from pagebatch.layers.linear import LinearBase
from pagebatch.quant.awq import AWQMethod
from pagebatch.quant.gptq import GPTQMethod
from pagebatch.quant.packing import default_g_idx, pack_awq, pack_gptq
from pagebatch.quant.wna16 import dequantize_canonical

from interpreted import (DEVICE, DTYPES, IN_PROCESS, ON_GPU, REL_TOL,  # noqa: F401
                         kernels_run_here, rel_err, run_under_interpreter)


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=600)


def _quant_layer(kind: str, k: int, n: int, bits: int, group_size: int, dtype, seed: int = 0):
    """A loaded AWQ or GPTQ layer of [n, k]; kind: awq, gptq, gptq_act (shuffled g_idx),
    gptq_irregular (a g_idx that is not runs of group_size)."""
    g = torch.Generator().manual_seed(seed)
    n_groups = 1 if group_size == -1 else k // group_size
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.int32)
    z = torch.randint(0, 2**bits, (n, n_groups), generator=g, dtype=torch.int32)
    s = (torch.rand(n, n_groups, generator=g) * 0.05 + 0.005).half()
    if kind == "awq":
        method = AWQMethod(None, {"quant_method": "awq", "group_size": group_size})
        tensors = pack_awq(q, z, s, group_size)
    else:
        g_idx = default_g_idx(k, group_size)
        if kind == "gptq_act":
            g_idx = g_idx[torch.randperm(k, generator=g)]
        elif kind == "gptq_irregular":
            g_idx = torch.randint(0, n_groups, (k,), generator=g, dtype=torch.int32)
        method = GPTQMethod(None, {"quant_method": "gptq", "bits": bits,
                                   "group_size": group_size, "desc_act": kind != "gptq",
                                   "checkpoint_format": "gptq_v2"})
        tensors = pack_gptq(q, z, s, g_idx, bits, group_size, "gptq_v2")
    layer = LinearBase(k, [n], False, method, dtype, DEVICE)
    for name in sorted(tensors):
        layer.load(name, tensors[name], None)
    method.process_weights_after_loading(layer)
    return layer


# kind, bits, K, N, group_size
LAYERS = [("awq", 4, 128, 64, 32), ("awq", 4, 64, 32, -1), ("gptq", 8, 128, 32, 64),
          ("gptq_act", 4, 128, 32, 32), ("gptq_irregular", 4, 64, 32, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,bits,k,n,group_size", LAYERS)
@pytest.mark.parametrize("m,block_k,split_k", [(1, 32, 1), (3, 32, 2), (19, 64, 1)])
def test_gemm_equals_dequantized(kind, bits, k, n, group_size, m, block_k, split_k, dtype):
    """Every group mode (one group per K tile; group < BLOCK_K; g_idx per row), split-K and
    masked edges (M not a multiple of BLOCK_M)."""
    from pagebatch.quant.kernels.wna16 import wna16_gemm

    layer = _quant_layer(kind, k, n, bits, group_size, dtype)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    wt = dequantize_canonical(layer.qweight, layer.scales, layer.zeros, bits, layer.wgroup_size,
                              layer.g_idx).float()
    out = wna16_gemm(x, layer.qweight, layer.scales, layer.zeros, bits, layer.wgroup_size,
                     layer.g_idx, block_m=16, block_n=32, block_k=block_k, split_k=split_k)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, x.float() @ wt) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,bits,k,n,group_size",
                         [("awq", 4, 256, 64, 64), ("awq", 4, 128, 40, -1),
                          ("gptq", 8, 256, 48, 64), ("gptq", 4, 512, 32, 128)])
@pytest.mark.parametrize("m,block_n,block_kp,split_k", [(1, 32, 8, 1), (1, 16, 4, 3),
                                                        (3, 32, 8, 4), (2, 64, 4, 16)])
def test_gemv_equals_dequantized(kind, bits, k, n, group_size, m, block_n, block_kp, split_k,
                                 dtype):
    """The CUDA-core GEMV: every field position of the in-place float conversion, masked N
    edges, split-K with the last-arriving program adding the partials (more splits than K
    tiles too), and the counters left at zero for the next launch."""
    from pagebatch.quant.kernels import wna16_gemv as gemv

    layer = _quant_layer(kind, k, n, bits, group_size, dtype)
    gs = layer.wgroup_size
    block_kp = min(block_kp, gs // (32 // bits))
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    wt = dequantize_canonical(layer.qweight, layer.scales, layer.zeros, bits, gs).float()
    for _ in range(2):  # a second launch reuses the counters
        out = gemv.wna16_gemv(x, layer.qweight, layer.scales, layer.zeros, bits, gs,
                              block_n=block_n, block_kp=block_kp, split_k=split_k)
        assert out.dtype == dtype and out.shape == (m, n)
        # the fp32 sums carry the float bases 2**11 / 2**7 (wna16_gemv.py): ~2**-13 relative
        assert rel_err(out, x.float() @ wt) < max(REL_TOL[dtype], 2e-4)
    if split_k > 1:
        from pagebatch.kernels.splitk import counter_buffer

        assert not counter_buffer(x.device).any()


def test_gemv_rejects_tiles_across_groups():
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    layer = _quant_layer("awq", 128, 32, 4, 32, torch.float16)
    x = torch.randn(1, 128, device=DEVICE).half()
    with pytest.raises(ValueError, match="group size 32"):
        wna16_gemv(x, layer.qweight, layer.scales, layer.zeros, 4, 32, block_n=32, block_kp=8)


@pytest.mark.parametrize("kind,bits,k,n,group_size", LAYERS[:4])
def test_dequantize_kernel_is_exact(kind, bits, k, n, group_size):
    from pagebatch.quant.kernels.wna16 import wna16_dequantize

    layer = _quant_layer(kind, k, n, bits, group_size, torch.float16)
    ref = dequantize_canonical(layer.qweight, layer.scales, layer.zeros, bits,
                               layer.wgroup_size, layer.g_idx)
    out = wna16_dequantize(layer.qweight, layer.scales, layer.zeros, bits, layer.wgroup_size,
                           layer.g_idx, block_k=32, block_n=32)
    assert torch.equal(out, ref)


def test_matmul_paths_and_config():
    """wna16_matmul's choice of path by M: the heuristic config (split-K for decode) and the
    dequantize + matmul path from dense_min_m rows."""
    from pagebatch.quant.kernels.wna16 import pick_config, wna16_matmul

    cfg = pick_config(1, 256, 4096, 128, False, DEVICE)
    assert cfg["kernel"] == "gemv" and cfg["split_k"] > 1
    cfg = pick_config(2, 256, 4096, 128, False, DEVICE)
    assert cfg["kernel"] == "gemm" and cfg["split_k"] > 1 and cfg["block_m"] == 16
    assert pick_config(1, 256, 4096, 128, True, DEVICE)["kernel"] == "gemm"  # g_idx
    assert pick_config(512, 4096, 4096, 32, False, DEVICE)["block_k"] == 32
    layer = _quant_layer("awq", 128, 64, 4, 32, torch.float16)
    x = torch.randn(20, 128, device=DEVICE).half()
    ref = x.float() @ layer.quant_method.dequantized_weight(layer).float().t()
    for dense_min_m in (10**9, 1):
        out = wna16_matmul(x, layer.qweight, layer.scales, layer.zeros, 4, 32,
                           dense_min_m=dense_min_m)
        assert rel_err(out, ref) < REL_TOL[torch.float16]


@pytest.mark.parametrize("m", [1, 3, 20])
def test_matmul_on_a_shards_columns(m):
    """The per-shard act-order fallback (quant/wna16.py ``shard_orders``) runs the products on
    column slices of the layer's tensors (row stride N, unit column stride): the GEMV, the GEMM
    and the dense path equal the product on contiguous copies."""
    from pagebatch.quant.kernels.wna16 import wna16_matmul

    layer = _quant_layer("gptq_act", 128, 96, 4, 32, torch.float16)
    x = torch.randn(m, 128, device=DEVICE).half()
    cols = slice(32, 80)
    parts = [t[:, cols] for t in (layer.qweight, layer.scales, layer.zeros)]
    q, sc, zz = (t.contiguous() for t in parts)
    ref = x.float() @ dequantize_canonical(q, sc, zz, 4, 32).float()
    for dense_min_m in (10**9, 1):
        out = wna16_matmul(x, *parts, 4, 32, dense_min_m=dense_min_m)
        assert rel_err(out, ref) < REL_TOL[torch.float16]


@pytest.mark.skipif(not ON_GPU, reason="whole layers run the kernels only on CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,bits,k,n,group_size",
                         [("awq", 4, 4096, 4096, 128), ("gptq_act", 4, 4096, 1024, 128),
                          ("gptq", 8, 2048, 4096, 128)])
@pytest.mark.parametrize("m", [1, 8, 100, 2048])
def test_layer_apply_on_gpu(kind, bits, k, n, group_size, m, dtype):
    layer = _quant_layer(kind, k, n, bits, group_size, dtype)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    ref = x.float() @ layer.quant_method.dequantized_weight(layer).float().t()
    assert rel_err(layer(x), ref) < REL_TOL[dtype]


def test_tuned_table_lookup(tmp_path, monkeypatch):
    """A sweep's table (quant/kernels/tuned.py) from $PAGEBATCH_KERNEL_CONFIG_DIR: the entry of
    the smallest measured M at or above the rows asked for; none past the largest."""
    import json

    from pagebatch.kernels import tuned

    table = {"bits=4,n=64,k=128,group=32": {"1": {"kernel": "gemv", "block_n": 32},
                                            "8": {"kernel": "gemm", "block_m": 16}}}
    (tmp_path / "wna16_Fake_GPU.json").write_text(json.dumps(table))
    monkeypatch.setenv(tuned.ENV_DIR, str(tmp_path))
    tuned.clear_caches()
    try:
        by_m = tuned.load_table("wna16", "Fake_GPU")["bits=4,n=64,k=128,group=32"]
        assert tuned.select(by_m, 1)["kernel"] == "gemv"
        assert tuned.select(by_m, 2)["kernel"] == "gemm"
        assert tuned.select(by_m, 9) is None
        assert tuned.load_table("wna16", "Other_GPU") == {}
    finally:
        tuned.clear_caches()
