"""quant/packing.py against itself (round trips) and against the reference libraries' own code.

AutoAWQ (autoawq 0.2.9) and AutoGPTQ (auto-gptq 0.7.1) are installed with ``--no-deps``
(requirements-ref.txt, scripts/setup --test); their package imports pull in CUDA extensions and
half of the Hugging Face stack, so the module files holding the packing code are loaded
directly (importlib ``spec_from_file_location``):

- AutoAWQ ``awq/modules/linear/gemm.py``: ``WQLinear_GEMM.from_linear`` (the packer that
  writes every AutoAWQ GEMM checkpoint), with ``awq/utils/packing_utils.py``
  (``dequantize_gemm``: its unpacker) loaded as its import;
- AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda.py``: ``QuantLinear.pack`` (v1 format,
  act-order g_idx) and its torch forward (the dequantize + matmul path used without CUDA).

Without the packages (e.g. another Python than the cp311 auto-gptq wheel) those tests skip.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from pagebatch.quant.packing import (AWQ_ORDER, dequantize, dequantize_awq, dequantize_gptq,
                                     default_g_idx, pack_awq, pack_gptq,
                                     quantize_fp8_per_channel, quantize_int8_per_channel,
                                     unpack_awq, unpack_gptq)


def _pkg_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)  # finds the package without running its __init__
    return spec.submodule_search_locations[0] if spec and spec.submodule_search_locations \
        else None


def _load_file(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def awq_ref():
    """AutoAWQ's gemm.py and packing_utils.py, with stand-ins for the ``awq`` packages so that
    ``awq/__init__.py`` (which imports every model class) never runs."""
    root = _pkg_dir("awq")
    if root is None:
        pytest.skip("autoawq is not installed (pip install --no-deps -r requirements-ref.txt)")
    stubs = {"awq": root, "awq.utils": f"{root}/utils", "awq.modules": f"{root}/modules"}
    saved = {k: v for k, v in sys.modules.items() if k == "awq" or k.startswith("awq.")}
    for name, path in stubs.items():
        m = types.ModuleType(name)
        m.__path__ = [path]
        sys.modules[name] = m
    try:
        gemm = _load_file("_ref_awq_gemm", f"{root}/modules/linear/gemm.py")
        packing = sys.modules["awq.utils.packing_utils"]
    finally:
        for k in [k for k in sys.modules if k == "awq" or k.startswith("awq.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return gemm, packing


@pytest.fixture(scope="module")
def gptq_ref():
    root = _pkg_dir("auto_gptq")
    if root is None:
        pytest.skip("auto-gptq is not installed (pip install --no-deps -r requirements-ref.txt)")
    return _load_file("_ref_gptq_qlinear_cuda", f"{root}/nn_modules/qlinear/qlinear_cuda.py")


def _random_convention(out, k, bits, group_size, seed=0, zero_min=0):
    g = torch.Generator().manual_seed(seed)
    n_groups = 1 if group_size == -1 else k // group_size
    q = torch.randint(0, 2**bits, (out, k), generator=g, dtype=torch.int32)
    z = torch.randint(zero_min, 2**bits, (out, n_groups), generator=g, dtype=torch.int32)
    s = (torch.rand(out, n_groups, generator=g) * 0.05 + 0.005).half()
    return q, z, s


# ---- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_awq_round_trip(group_size):
    q, z, s = _random_convention(64, 256, 4, group_size)
    d = pack_awq(q, z, s, group_size)
    gs = 256 if group_size == -1 else group_size
    assert d["qweight"].shape == (256, 8) and d["qweight"].dtype == torch.int32
    assert d["qzeros"].shape == (256 // gs, 8) and d["scales"].shape == (256 // gs, 64)
    q2, z2, s2 = unpack_awq(d["qweight"], d["qzeros"], d["scales"], group_size)
    assert torch.equal(q2, q) and torch.equal(z2, z) and torch.equal(s2, s)


def test_awq_nibble_order():
    """Word c, nibble j holds output 8c + AWQ_ORDER[j]: output o's value o % 16 lands there."""
    q = (torch.arange(16)[:, None] % 16).expand(16, 8).to(torch.int32)  # [out=16, in=8]
    d = pack_awq(q, torch.zeros(16, 1, dtype=torch.int32), torch.ones(16, 1), -1)
    word = int(d["qweight"][0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == AWQ_ORDER


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_round_trip(bits, fmt, group_size, act_order):
    k = 128
    q, z, s = _random_convention(32, k, bits, group_size, zero_min=1 if fmt == "gptq" else 0)
    g_idx = default_g_idx(k, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(1))]
    d = pack_gptq(q, z, s, g_idx if act_order else None, bits, group_size, fmt)
    assert d["qweight"].shape == (k * bits // 32, 32) and d["qzeros"].shape[1] == 32 * bits // 32
    q2, z2, s2, g2 = unpack_gptq(d["qweight"], d["qzeros"], d["scales"], d["g_idx"], bits,
                                 group_size, fmt)
    assert torch.equal(q2, q) and torch.equal(z2, z) and torch.equal(s2, s)
    assert torch.equal(g2, g_idx)
    w = dequantize_gptq(d["qweight"], d["qzeros"], d["scales"], d["g_idx"], bits, group_size, fmt)
    assert torch.equal(w, dequantize(q, z, s, g_idx))


def test_gptq_v1_rejects_zero_point_0_and_v2_keeps_it():
    q, z, s = _random_convention(16, 64, 4, 32)
    z[0, 0] = 0
    with pytest.raises(ValueError, match="zero point of 0"):
        pack_gptq(q, z, s, None, 4, 32, "gptq")
    d = pack_gptq(q, z, s, None, 4, 32, "gptq_v2")
    assert int(unpack_gptq(d["qweight"], d["qzeros"], d["scales"], None, 4, 32,
                           "gptq_v2")[1][0, 0]) == 0


def test_packers_reject_bad_input():
    q, z, s = _random_convention(16, 64, 4, 32)
    with pytest.raises(ValueError, match="group_size=48"):
        pack_awq(q, z, s, 48)
    with pytest.raises(ValueError, match="bits=3"):
        pack_gptq(q, z, s, None, 3, 32)
    with pytest.raises(ValueError, match="cannot be packed"):
        pack_awq(q + 16, z, s, 32)


def test_int8_and_fp8_per_channel():
    w = torch.randn(32, 64) * torch.linspace(0.01, 2.0, 32)[:, None]
    q, s = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (32,) and int(q.abs().max()) == 127
    assert torch.allclose(q.float() * s[:, None], w, atol=float(s.max()) / 2 + 1e-6)
    f, s8 = quantize_fp8_per_channel(w)
    assert f.dtype == torch.float8_e4m3fn and s8.shape == (32,)
    rel = ((f.float() * s8[:, None] - w).norm() / w.norm()).item()
    assert rel < 0.04  # e4m3: 3 mantissa bits


# ---- against the reference libraries' code -----------------------------------------------------

@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_pack_matches_autoawq(awq_ref, group_size):
    """AutoAWQ's own packer (WQLinear_GEMM.from_linear) writes the same qweight and qzeros
    from the same integers, and its unpacker (dequantize_gemm) reads back our weight."""
    gemm, packing = awq_ref
    out, k = 64, 256
    q, z, s = _random_convention(out, k, 4, group_size, seed=3)
    w = dequantize(q, z, s, default_g_idx(k, group_size)).float()
    linear = torch.nn.Linear(k, out, bias=False)
    linear.weight.data = w
    ref = gemm.WQLinear_GEMM.from_linear(linear, 4, group_size, scales=s.t().contiguous(),
                                         zeros=z.t().contiguous())
    ours = pack_awq(q, z, s, group_size)
    assert torch.equal(ref.qweight, ours["qweight"])
    assert torch.equal(ref.qzeros, ours["qzeros"])
    assert torch.equal(ref.scales, ours["scales"])
    ref_w = packing.dequantize_gemm(ours["qweight"], ours["qzeros"], ours["scales"], 4,
                                    group_size)  # [in, out]
    assert torch.equal(ref_w.t(), dequantize_awq(ours["qweight"], ours["qzeros"],
                                                 ours["scales"], group_size))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size,act_order", [(32, False), (32, True), (-1, False)])
def test_gptq_pack_matches_autogptq(gptq_ref, bits, group_size, act_order):
    """AutoGPTQ's QuantLinear.pack (v1) writes the same tensors from the same integers, and its
    torch forward (dequantize + matmul) equals ours on random inputs."""
    out, k = 64, 128
    q, z, s = _random_convention(out, k, bits, group_size, seed=4, zero_min=1)
    s = s.float()
    g_idx = default_g_idx(k, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(2))]
    linear = torch.nn.Linear(k, out, bias=False)
    linear.weight.data = dequantize(q, z, s, g_idx)
    ref = gptq_ref.QuantLinear(bits, group_size, k, out, False, weight_dtype=torch.float32)
    ref.pack(linear, s, z.clone(), g_idx=g_idx)  # it decrements zeros in place
    ours = pack_gptq(q, z, s, g_idx, bits, group_size, "gptq")
    assert torch.equal(ref.qweight, ours["qweight"])
    assert torch.equal(ref.qzeros, ours["qzeros"])
    assert torch.equal(ref.g_idx.to(torch.int32), ours["g_idx"])
    x = torch.randn(5, k)
    with torch.no_grad():
        y_ref = ref(x)
    w = dequantize_gptq(ours["qweight"], ours["qzeros"], ours["scales"], ours["g_idx"], bits,
                        group_size, "gptq")
    torch.testing.assert_close(y_ref, x @ w.t(), rtol=1e-5, atol=1e-5)
